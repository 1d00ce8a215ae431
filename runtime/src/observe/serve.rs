//! The watch's HTTP listener: `/metrics` for Prometheus, `/` the live
//! page, `/api/state` its data. Beyond loopback it serves only over TLS
//! and with a token (`Authorization: Bearer`; a browser opens the page as
//! `/#token=`, and the page sends it in the header of its own requests).

use super::Watch;
use axum::{
    Router,
    extract::{Query, State},
    http::{HeaderMap, StatusCode, header},
    response::{Html, IntoResponse, Response},
    routing::get,
};
use std::{net::SocketAddr, sync::Arc, time::Instant};

/// Who may watch: a token every request must carry, and the TLS
/// certificate and key (PEM) to serve with.
#[derive(Clone, Default)]
pub struct WatchAccess {
    pub token: Option<String>,
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
}

/// Where the watch is served.
#[derive(Clone, Debug)]
pub struct Listening {
    pub addr: SocketAddr,
    pub tls: bool,
}

impl Listening {
    /// The page's address (`http://127.0.0.1:9464/`).
    pub fn url(&self) -> String {
        format!("{}://{}/", if self.tls { "https" } else { "http" }, self.addr)
    }
}

/// Why the watch cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(
        "--metrics-listen {0}: beyond loopback the page and metrics are served only over TLS \
         (--metrics-tls-cert, --metrics-tls-key) and with a token (--metrics-token-file)"
    )]
    InClear(SocketAddr),
    #[error("--metrics-listen {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    #[error("--metrics-tls-cert: {0}")]
    Tls(crate::distill::rest::TlsConfigError),
    #[error("the watch's server: {0}")]
    Runtime(std::io::Error),
}

#[derive(Clone)]
struct Served {
    watch: Watch,
    token: Option<Arc<str>>,
    started: Instant,
    /// Where it listens: without a token, the only `Host` it answers (as
    /// `127.0.0.1:9464`, `localhost:9464` or `[::1]:9464`).
    port: u16,
}

/// Serves `watch` on `addr` from a thread of its own, for as long as the
/// process runs; returns where, once it listens.
pub fn serve(addr: SocketAddr, watch: Watch, access: WatchAccess) -> Result<Listening, ServeError> {
    if !addr.ip().is_loopback() && (access.token.is_none() || access.tls.is_none()) {
        return Err(ServeError::InClear(addr));
    }
    let tls = match &access.tls {
        Some((cert, key)) => Some(crate::distill::rest::tls_config(cert, key).map_err(ServeError::Tls)?),
        None => None,
    };
    let listener = std::net::TcpListener::bind(addr).map_err(|e| ServeError::Bind(addr, e))?;
    listener.set_nonblocking(true).map_err(|e| ServeError::Bind(addr, e))?;
    let bound = listener.local_addr().map_err(|e| ServeError::Bind(addr, e))?;
    let served =
        Served { watch, token: access.token.map(Arc::from), started: Instant::now(), port: bound.port() };
    let rt =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(ServeError::Runtime)?;
    std::thread::Builder::new()
        .name("edl-watch".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => return tracing::warn!("the watch's listener: {e}"),
                };
                let router = router(served);
                match tls {
                    Some(config) => {
                        crate::distill::rest::serve_tls(listener, router, config, "the watch").await
                    }
                    None => crate::distill::rest::serve(listener, router, "the watch").await,
                }
            })
        })
        .map_err(ServeError::Runtime)?;
    Ok(Listening { addr: bound, tls: access.tls.is_some() })
}

fn router(served: Served) -> Router {
    Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/metrics", get(metrics))
        .route("/api/state", get(state))
        .route("/healthz", get(|| async { "ok\n" }))
        .fallback(|| async { (StatusCode::NOT_FOUND, "no such page: try /, /metrics or /api/state\n") })
        .layer(axum::middleware::from_fn_with_state(served.clone(), admit))
        .with_state(served)
}

/// The live page: one file, no scripts from elsewhere.
const PAGE: &str = include_str!("page.html");

#[derive(serde::Deserialize)]
struct Asked {
    since: Option<u64>,
}

/// Refuses a request without the token (health checks and the page
/// itself excepted: it holds nothing of the job, and asks for the job's
/// state with the token the browser's address gives it); without a token,
/// one whose `Host` is not this loopback listener's (a web page whose name
/// was rebound to 127.0.0.1 must not read the job).
async fn admit(
    State(s): State<Served>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path();
    if path == "/healthz" || (path == "/" && s.token.is_some()) {
        return next.run(req).await;
    }
    match &s.token {
        Some(token) if !carries(req.headers(), token) => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "this job's watch needs its token: Authorization: Bearer TOKEN (in a browser, open the page as /#token=TOKEN)\n",
        )
            .into_response(),
        None if !crate::net::loopback_host(req.uri(), req.headers(), s.port) => (
            StatusCode::FORBIDDEN,
            "this job's watch answers only loopback names (127.0.0.1, localhost, [::1]) at its port\n",
        )
            .into_response(),
        _ => next.run(req).await,
    }
}

/// Whether a request carries `token` in its `Authorization` header (never
/// in its address, which proxies and servers log).
fn carries(headers: &HeaderMap, token: &str) -> bool {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("Bearer"))
        .map(|(_, t)| t.trim());
    bearer.is_some_and(|given| crate::distill::teacher::same_secret(given.as_bytes(), token.as_bytes()))
}

async fn metrics(State(s): State<Served>) -> Response {
    ([(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)], s.watch.metrics_text()).into_response()
}

async fn state(State(s): State<Served>, Query(asked): Query<Asked>) -> Response {
    axum::Json(s.watch.live(asked.since, s.started)).into_response()
}
