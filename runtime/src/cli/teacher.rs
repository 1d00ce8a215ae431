//! `edl-runtime teacher`: a model served over the Open Inference Protocol
//! (KServe v2 gRPC, and REST with --http-listen), registered in a store.

use super::flags::{listen_on, read_token};
use anyhow::{Context, Result, bail};
use clap::Args;
use edl_runtime::{distill::teacher, leader::seal::RecordKey, store::AnyStore, trainer::model::Mlp};
use std::io::Write;
use std::{net::SocketAddr, path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

#[derive(Args)]
pub struct TeacherArgs {
    /// The model, a safetensors file of the runtime's MLP.
    #[arg(long, value_name = "FILE", help_heading = "Serving")]
    model: PathBuf,
    /// Model name clients ask for.
    #[arg(long, value_name = "NAME", default_value = "teacher", help_heading = "Serving")]
    model_name: String,
    /// Address to serve gRPC on, with or without a port (without: 8001;
    /// port 0 picks a free one).
    #[arg(long, value_name = "ADDR[:PORT]", default_value = "127.0.0.1:8001", value_parser = listen_on(8001), help_heading = "Serving")]
    listen: SocketAddr,
    /// Also serve KServe v2 over HTTP/REST on this address, with or without
    /// a port (without: 8000): `/v2/...` health, metadata, infer with JSON
    /// or binary tensors, config, stats; the same token, and HTTPS with the
    /// same certificate when --tls-cert is given.
    #[arg(long, value_name = "ADDR[:PORT]", value_parser = listen_on(8000), help_heading = "Serving")]
    http_listen: Option<SocketAddr>,
    /// Host name or address students reach this teacher at, registered with
    /// the port (default: the listen address; this host's routable address
    /// when listening on all interfaces).
    #[arg(long, value_name = "HOST", help_heading = "Serving")]
    advertise: Option<String>,
    /// Where to register: `memory` (this process only) or `redis://host:port`
    /// (a URL with a password is better given in $EDL_STORE).
    #[arg(
        long,
        value_name = "URL",
        default_value = "memory",
        env = "EDL_STORE",
        hide_env_values = true,
        help_heading = "Registration"
    )]
    store: String,
    /// Service name the teacher registers under.
    #[arg(long, value_name = "NAME", default_value = "teachers", help_heading = "Registration")]
    service: String,
    /// The job's teacher registration key (64 hex digits; a job that finds
    /// its teachers in a store writes it to .edl/<job>/teacher-registration.key).
    /// Students ignore registrations not sealed with it. Needed with a
    /// shared --store; also read from $EDL_TEACHER_REGISTRATION_KEY.
    #[arg(long, value_name = "FILE", help_heading = "Registration")]
    registration_key_file: Option<PathBuf>,
    /// Most rows run through the model together (concurrent requests are batched up to it).
    #[arg(long, value_name = "ROWS", default_value_t = 512, help_heading = "Batching")]
    max_batch: usize,
    /// Longest the first request of a batch waits for others to join it, ms.
    #[arg(long, value_name = "MS", default_value_t = 2, help_heading = "Batching")]
    max_delay_ms: u64,
    /// Most rows one request may hold; larger ones are refused
    /// (RESOURCE_EXHAUSTED), and the transport refuses messages that could
    /// only hold more before reading them.
    #[arg(long, value_name = "ROWS", default_value_t = 4096, help_heading = "Batching")]
    max_request_rows: usize,
    /// When told to stop (SIGTERM, Ctrl-C): seconds it goes on serving once
    /// deregistered, for students to stop sending to it (they look at the
    /// store every 200 ms), before it finishes what it holds and exits.
    #[arg(long, value_name = "SECS", default_value_t = 1.0, help_heading = "Registration")]
    drain_secs: f64,
    /// Emulate an accelerator: each batch also takes this many microseconds
    /// per row, one batch at a time (a sleep, not compute: for measuring
    /// pools of teachers on a machine without their devices).
    #[arg(long, value_name = "US", default_value_t = 0, help_heading = "Batching")]
    emulate_row_us: u64,
    /// A file holding the bearer token every call must carry
    /// (`authorization: Bearer TOKEN`); without it any client may call.
    #[arg(long, value_name = "FILE", help_heading = "Access")]
    token_file: Option<PathBuf>,
    /// Serve TLS with this certificate (PEM, with its chain); needs --tls-key.
    /// The teacher registers as `grpcs://host:port`.
    #[arg(long, value_name = "FILE", help_heading = "Access")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, value_name = "FILE", help_heading = "Access")]
    tls_key: Option<PathBuf>,
}

/// Serves until Ctrl-C or SIGTERM, then deregisters.
pub fn run(args: TeacherArgs) -> Result<ExitCode> {
    let model = Mlp::load(&args.model)?;
    let token = read_token(args.token_file.as_deref(), "--token-file")?;
    // Either listener open beyond this host carries the token in clear without TLS.
    let open = std::iter::once(args.listen).chain(args.http_listen).filter(|a| !a.ip().is_loopback());
    for at in open.filter(|_| token.is_some() && args.tls_cert.is_none()) {
        eprintln!("warning: --token-file without --tls-cert: students send the token in clear to {at}");
    }
    let access = teacher::Access {
        token: token.clone(),
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(c), Some(k)) => Some((
                std::fs::read(c).with_context(|| format!("--tls-cert {}", c.display()))?,
                std::fs::read(k).with_context(|| format!("--tls-key {}", k.display()))?,
            )),
            (None, None) => None,
            _ => edl_runtime::refuse!("--tls-cert and --tls-key go together"),
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(serve(args, model, access, token))
}

/// The key this teacher seals its registration with: `--registration-key-file`,
/// else `$EDL_TEACHER_REGISTRATION_KEY`; a teacher registering only in this
/// process's memory needs none (it makes one).
fn registration_key(args: &TeacherArgs) -> Result<RecordKey> {
    let env = edl_runtime::job::teacher_pool::REGISTRATION_KEY_ENV;
    let (text, from) = match &args.registration_key_file {
        Some(f) => (
            std::fs::read_to_string(f).with_context(|| format!("--registration-key-file {}", f.display()))?,
            format!("--registration-key-file {}", f.display()),
        ),
        None => match std::env::var(env) {
            Ok(v) => (v, format!("${env}")),
            Err(_) if args.store == "memory" => {
                return Ok(RecordKey::teacher_registrations(
                    &edl_runtime::worker::session::Secret::generate()?,
                ));
            }
            Err(_) => bail!(
                "a teacher registering in a shared --store needs the job's registration key: \
                 --registration-key-file .edl/<job>/teacher-registration.key (students ignore registrations \
                 without it)"
            ),
        },
    };
    RecordKey::from_hex(&text)
        .ok_or_else(|| anyhow::anyhow!("{from}: not a registration key (64 hex digits)"))
}

async fn serve(
    args: TeacherArgs,
    model: Mlp,
    access: teacher::Access,
    token: Option<String>,
) -> Result<ExitCode> {
    // Heard from before the teacher says where it serves: whoever reads
    // that and stops it at once (SIGTERM) gets a clean stop, not a kill.
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
    let store = Arc::new(AnyStore::open(&args.store)?);
    let config = teacher::TeacherConfig {
        model_name: args.model_name.clone(),
        max_batch: args.max_batch,
        max_delay: Duration::from_millis(args.max_delay_ms),
        max_request_rows: args.max_request_rows,
        emulate_row: Duration::from_micros(args.emulate_row_us),
        ..Default::default()
    };
    let (inputs, outputs) = (model.input_dim(), model.output_dim());
    let service = teacher::TeacherService::new(model, config);
    let registration = Some(teacher::Registration {
        store,
        service: args.service.clone(),
        ttl: Duration::from_secs(3),
        key: registration_key(&args)?,
    });
    let rest_tls = match &access.tls {
        Some((cert, key)) if args.http_listen.is_some() => Some(
            edl_runtime::distill::rest::tls_config(cert, key)
                .map_err(|e| anyhow::anyhow!("--tls-cert: {e}"))?,
        ),
        _ => None,
    };
    let serving =
        teacher::Serving { advertise: args.advertise.clone(), access, ..teacher::Serving::on(args.listen) }
            .max_rows(args.max_request_rows, inputs);
    let rest = args.http_listen.map(|a| (a, service.clone(), token));
    let counted = service.clone();
    let t = teacher::Teacher::serve(serving, service, registration).await?;
    println!(
        "teacher {:?} ({inputs} -> {outputs}) serving on {} as service {:?} (store {})",
        args.model_name,
        t.advertised,
        args.service,
        edl_runtime::store::redact(&args.store)
    );
    if let Some((addr, service, token)) = rest {
        let listener =
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("--http-listen {addr}"))?;
        let at = listener.local_addr()?;
        let max_body = edl_runtime::distill::rest::max_body(args.max_request_rows, inputs);
        let router = edl_runtime::distill::rest::router(service, token, max_body, at);
        use edl_runtime::distill::rest::{serve, serve_tls};
        const WHAT: &str = "teacher REST endpoint";
        let scheme = if rest_tls.is_some() { "https" } else { "http" };
        match rest_tls {
            Some(config) => tokio::spawn(serve_tls(listener, router, config, WHAT)),
            None => tokio::spawn(serve(listener, router, WHAT)),
        };
        println!("teacher {:?} serving KServe v2 REST on {scheme}://{at}", args.model_name);
    }
    let drain = super::flags::secs(args.drain_secs, "drain-secs")?;
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    tracing::info!("teacher on {}: stopping: deregistered, serving for {:?} more", t.addr, drain);
    let at = t.advertised.clone();
    t.drain_and_shutdown(drain).await;
    let (rows, requests, failed) = counted.served();
    // Whoever started it may have stopped reading its output: not an error.
    let said = format!("teacher on {at}: served {rows} rows in {requests} requests ({failed} failed)");
    let _ = writeln!(std::io::stdout().lock(), "{said}");
    Ok(ExitCode::SUCCESS)
}
