//! Teachers for the main job: a wider MLP trained by the runtime itself
//! (plain training on hard labels), cached as safetensors so later runs
//! skip the training, and served by `edl-runtime teacher` processes.

use crate::process::{die_with_parent, log_tail, terminate};
use crate::trainer::data::{self, Dataset};
use crate::trainer::model::Mlp;
use crate::trainer::train::Trainer;
use anyhow::{Context, Result, anyhow, bail};
use edl_host_gpu::{Device, loss::SoftLabelLoss};
use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

/// How the teacher model is trained.
#[derive(Clone, Debug)]
pub struct TeacherTraining {
    pub layers: Vec<usize>,
    pub epochs: u64,
    pub batch: usize,
    pub lr: f32,
    pub momentum: f32,
    pub seed: u64,
    /// Where it trains (the weights do not depend on it beyond rounding).
    pub device: Device,
}

impl TeacherTraining {
    /// The cache file name: everything that decides the weights is in it.
    pub fn file_name(&self, dataset: &str, train_rows: usize) -> String {
        let layers: Vec<String> = self.layers.iter().map(|l| l.to_string()).collect();
        format!(
            "teacher-{dataset}-{train_rows}-{}-e{}-b{}-lr{}-m{}-s{}.safetensors",
            layers.join("x"),
            self.epochs,
            self.batch,
            self.lr,
            self.momentum,
            self.seed
        )
    }
}

/// The cached teacher model in `dir`, trained on `train` first when there is
/// none (or the cached one does not load). Returns the file and whether it
/// was trained now.
pub fn teacher_model(
    dir: &Path,
    dataset: &str,
    train: &Dataset,
    t: &TeacherTraining,
    mut progress: impl FnMut(u64, f32),
) -> Result<(PathBuf, Mlp, bool)> {
    let path = dir.join(t.file_name(dataset, train.len()));
    if path.exists() {
        match Mlp::load(&path) {
            Ok(m) => return Ok((path, m, false)),
            Err(e) => tracing::warn!("cached teacher unusable, training it again: {e}"),
        }
    }
    let mut trainer = Trainer::on(t.device, Mlp::random(&t.layers, t.seed))?;
    let loss = SoftLabelLoss { temperature: 1.0, alpha: 0.0 };
    let mut last = 0.0;
    for epoch in 0..t.epochs {
        let order = data::permutation(train.len(), t.seed ^ 0x7EAC, epoch);
        let (mut sum, mut rows) = (0.0, 0usize);
        for chunk in order.chunks(t.batch.max(1)) {
            let (x, y) = train.gather(chunk);
            sum += trainer.compute_gradient(&x, &y, None, &loss, y.len())?;
            rows += y.len();
            trainer.apply(t.lr, t.momentum)?;
        }
        last = (sum / rows.max(1) as f64) as f32;
        progress(epoch, last);
    }
    if !last.is_finite() {
        bail!("teacher training diverged (loss {last}); lower its learning rate");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
    let tmp = dir.join(format!(".tmp-{}", std::process::id()));
    trainer.model().save(&tmp)?;
    std::fs::rename(&tmp, &path).with_context(|| format!("{}", path.display()))?;
    Ok((path, trainer.into_model(), true))
}

/// A teacher process serving a model.
pub struct TeacherProcess {
    /// `host:port` it serves on, as students reach it.
    pub addr: String,
    /// None: taken over from a coordinator before (it runs on, not ours
    /// to wait for; its stop command stops it).
    child: Option<Child>,
    log: PathBuf,
    /// Started by `--teacher-command` (None: `edl-runtime teacher` here).
    by_command: Option<ByCommand>,
    /// Copies what it prints to its log (its last line, what it served,
    /// comes as it exits).
    copier: Option<std::thread::JoinHandle<()>>,
}

/// What the job keeps of a teacher it started by command.
struct ByCommand {
    slot: usize,
    /// The number its command was filled with (`{id}`).
    id: u32,
    /// It outlives a coordinator killed without notice, for the next to take over.
    lasting: bool,
    /// The stop command, filled in; run once, when it is told to go.
    stop: Option<String>,
    /// It was told to go by its stop command: its command is given the
    /// grace to end on its own before its group is signalled.
    told: bool,
    /// Its group was sent SIGTERM already.
    signalled: bool,
    /// Its endpoint's registration for the students (shared stores only).
    registered: Option<super::teacher_command::Registered>,
    /// Taken over (no process here to watch): when it was last asked
    /// whether it answers, and how many times in a row it did not.
    looked: Option<std::time::Instant>,
    misses: u32,
    /// The coordinator was deposed: the teacher is the new leader's, and
    /// nothing here stops or deregisters it.
    released: bool,
}

/// Looks in a row without an answer after which a teacher taken over is
/// taken for gone.
pub const ADOPTED_MISSES: u32 = 3;

/// The teacher processes a job started, watched by its coordinator: a dead
/// one is left out of the list new workers get, and the job stops, saying
/// why, when none is left.
pub trait TeacherWatch: Send {
    /// Teachers that have exited: (address, how, with the end of its log).
    fn dead(&mut self) -> Vec<(String, String)>;
}

impl TeacherWatch for std::sync::Arc<std::sync::Mutex<Vec<TeacherProcess>>> {
    fn dead(&mut self) -> Vec<(String, String)> {
        let mut all = self.lock().unwrap_or_else(|e| e.into_inner());
        all.iter_mut().filter_map(|t| Some((t.addr.to_string(), t.exited()?))).collect()
    }
}

/// How the teachers a job starts guard their endpoint: the job's teacher
/// token, and TLS with a certificate the job makes for them.
#[derive(Clone, Debug)]
pub struct TeacherGuard {
    pub token_file: Option<PathBuf>,
    pub tls: Option<TeacherTls>,
    /// The job's key teachers seal their registrations with (given to them
    /// in `EDL_TEACHER_REGISTRATION_KEY`, not on a command line).
    pub registration: crate::leader::seal::RecordKey,
}

/// A certificate the job made for its teachers, and its key.
#[derive(Clone, Debug)]
pub struct TeacherTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The certificate (PEM), which students trust.
    pub pem: String,
}

impl TeacherTls {
    /// A self-signed certificate for `host` (a name or an address), written
    /// to `dir` (the key readable by its owner only).
    pub fn make(dir: &Path, host: &str) -> Result<TeacherTls> {
        use std::os::unix::fs::OpenOptionsExt;
        let key = rcgen::KeyPair::generate().context("a key for the teachers' certificate")?;
        let names = vec![host.to_string(), "localhost".to_string(), "127.0.0.1".to_string()];
        let cert = rcgen::CertificateParams::new(names)
            .and_then(|p| p.self_signed(&key))
            .with_context(|| format!("a certificate for the teachers at {host}"))?;
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        let (cert_path, key_path) = (dir.join("teachers.crt"), dir.join("teachers.key"));
        let pem = cert.pem();
        std::fs::write(&cert_path, &pem).with_context(|| cert_path.display().to_string())?;
        let _ = std::fs::remove_file(&key_path);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&key_path)
            .with_context(|| key_path.display().to_string())?;
        std::io::Write::write_all(&mut f, key.serialize_pem().as_bytes())
            .with_context(|| key_path.display().to_string())?;
        Ok(TeacherTls { cert: cert_path, key: key_path, pem })
    }
}

/// Where a teacher finds the key it seals its registration with.
pub const REGISTRATION_KEY_ENV: &str = "EDL_TEACHER_REGISTRATION_KEY";

impl TeacherProcess {
    /// Starts `exe teacher --model M --listen IP:0 --advertise HOST --service V`
    /// (the store in `EDL_STORE`) and waits (up to 30 s) for the address it serves on.
    pub fn start(
        exe: &Path,
        model: &Path,
        (listen, advertise): (std::net::IpAddr, &str),
        (store, service): (&str, &str),
        guard: &TeacherGuard,
        emulate_row_us: u64,
        log: &Path,
    ) -> Result<Self> {
        let log_file = std::fs::File::create(log).with_context(|| format!("{}", log.display()))?;
        let mut cmd = Command::new(exe);
        let listen = SocketAddr::new(listen, 0).to_string();
        // The store's URL may hold a password: in the environment, not on
        // the command line where any user of the host could read it.
        cmd.args(["teacher", "--listen", &listen, "--advertise", advertise])
            .args(["--service", service, "--model"])
            .arg(model);
        if let Some(token) = &guard.token_file {
            cmd.arg("--token-file").arg(token);
        }
        if emulate_row_us > 0 {
            cmd.arg("--emulate-row-us").arg(emulate_row_us.to_string());
        }
        if let Some(tls) = &guard.tls {
            cmd.arg("--tls-cert").arg(&tls.cert).arg("--tls-key").arg(&tls.key);
        }
        // What it prints goes to its log too, after the first line is read.
        let mut said = log_file.try_clone().with_context(|| format!("{}", log.display()))?;
        cmd.env("EDL_STORE", store)
            .env(REGISTRATION_KEY_ENV, guard.registration.to_hex())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file);
        die_with_parent(&mut cmd);
        // As the workers: Ctrl-C is the coordinator's to act on.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        // Started from the pool's thread too, which ends before the teachers do.
        let mut child = crate::process::spawn_lasting(cmd)
            .with_context(|| format!("starting a teacher ({})", exe.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        let copier = std::thread::spawn(move || copy_output(stdout, &mut said, tx));
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) => l,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // It closed its output without saying where it serves: it exited.
                let status = child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                bail!("the teacher exited before serving ({status}){}", log_tail(log, 5));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                terminate(&mut child, Duration::from_secs(1));
                bail!("the teacher did not start within 30 s{}", log_tail(log, 5));
            }
        };
        let addr = line
            .split("serving on ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_string)
            .ok_or_else(|| anyhow!("unexpected teacher output {line:?} (log: {})", log.display()))?;
        Ok(TeacherProcess {
            addr,
            child: Some(child),
            log: log.to_path_buf(),
            by_command: None,
            copier: Some(copier),
        })
    }

    /// Runs `line` (a filled `--teacher-command`) with `sh -c` in a process
    /// group of its own, logging to `log`; once `ready` says its server
    /// answers, registers `endpoint` in `registry` (if any). A teacher that
    /// does not get ready is stopped, and the error says why, with its log.
    pub fn by_command(
        line: &str,
        endpoint: &str,
        (slot, id, stop, lasting): (usize, u32, Option<String>, bool),
        log: &Path,
        ready: impl FnOnce(&mut dyn FnMut() -> Option<String>) -> Result<()>,
        registry: Option<&super::teacher_command::Registry>,
    ) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let log_file = std::fs::File::create(log).with_context(|| format!("{}", log.display()))?;
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(line).stdin(Stdio::null()).stdout(log_file.try_clone()?).stderr(log_file);
        // The store's URL (and password) and the job's secret are not the
        // command's to see (srun, say, would carry them to the node).
        cmd.env_remove("EDL_STORE").env_remove("EDL_JOB_SECRET");
        cmd.process_group(0);
        // A lasting one (pooled, with a stop command, on a shared store)
        // outlives a coordinator killed without notice: the coordinator that
        // takes the job over takes it over (`adopted`). Others die with the
        // coordinator.
        if !lasting {
            die_with_parent(&mut cmd);
        }
        let child = crate::process::spawn_lasting(cmd).context("cannot run sh")?;
        let mut t = TeacherProcess {
            addr: endpoint.to_string(),
            child: Some(child),
            log: log.to_path_buf(),
            by_command: Some(ByCommand {
                slot,
                id,
                stop,
                lasting,
                told: false,
                signalled: false,
                registered: None,
                looked: None,
                misses: 0,
                released: false,
            }),
            copier: None,
        };
        let child = t.child.as_mut().expect("just started");
        let mut gone = || child.try_wait().ok().flatten().map(|s| s.to_string());
        if let Err(e) = ready(&mut gone) {
            // Dropped: stopped with its group.
            return Err(e.context(format!("teacher {endpoint}{}", log_tail(log, 5))));
        }
        // Ready, and its command still runs: the answer was its own.
        if let Some(how) = gone() {
            bail!(
                "teacher {endpoint}: its command exited ({how}) though a server answers there: another \
                 server holds the slot{}",
                log_tail(log, 5)
            );
        }
        if let Some(r) = registry {
            let held = r.hold(endpoint)?;
            if let Some(c) = t.by_command.as_mut() {
                c.registered = Some(held);
            }
        }
        Ok(t)
    }

    /// A teacher started by command by the coordinator this one took the
    /// job over from, serving at `endpoint` on `slot`: this coordinator
    /// registers it for the students (where `registry` is given) and
    /// stops it with `stop`.
    pub fn adopted(
        endpoint: &str,
        (slot, id, stop): (usize, u32, String),
        log: &Path,
        registry: Option<&super::teacher_command::Registry>,
    ) -> Result<Self> {
        let registered = registry.map(|r| r.hold(endpoint)).transpose()?;
        Ok(TeacherProcess {
            addr: endpoint.to_string(),
            child: None,
            log: log.to_path_buf(),
            by_command: Some(ByCommand {
                slot,
                id,
                stop: Some(stop),
                lasting: true,
                told: false,
                signalled: false,
                registered,
                looked: None,
                misses: 0,
                released: false,
            }),
            copier: None,
        })
    }

    /// The slot of `--teacher-hosts` it runs on, if started by command.
    pub fn slot(&self) -> Option<usize> {
        self.by_command.as_ref().map(|c| c.slot)
    }

    /// What a coordinator taking the job over needs to take it over: one
    /// started by command that outlives this coordinator (it has a stop
    /// command and a registration in a shared store).
    pub fn handle(&self) -> Option<crate::leader::record::TeacherHandle> {
        let c = self.by_command.as_ref()?;
        // Not once told to go (its stop command taken).
        (c.lasting && c.stop.is_some()).then(|| crate::leader::record::TeacherHandle {
            addr: self.addr.clone(),
            slot: c.slot,
            id: c.id,
        })
    }

    /// The coordinator was deposed: a teacher that outlives it (see
    /// [`handle`](Self::handle)) is the coordinator's that leads now, and is
    /// let go: not stopped, not signalled, not deregistered (its
    /// registration lapses unless the new leader holds it). Whether it was.
    pub fn release(&mut self) -> bool {
        if self.handle().is_none() {
            return false;
        }
        if let Some(c) = self.by_command.as_mut() {
            c.released = true;
            // Dropped without a word: no longer renewed by this process.
            drop(c.registered.take());
        }
        // A `Child` dropped is not killed.
        drop(self.child.take());
        true
    }

    /// Takes its endpoint out of the store (a teacher started by command;
    /// `edl-runtime teacher` deregisters itself on SIGTERM). Whether there
    /// was one to take out.
    pub fn deregister(&mut self) -> bool {
        match self.by_command.as_mut().and_then(|c| c.registered.as_mut()) {
            Some(r) => {
                r.release();
                true
            }
            None => false,
        }
    }

    /// How it ended, with the end of its log, once it has exited (one
    /// started by command is taken out of the store then).
    pub fn exited(&mut self) -> Option<String> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.deregister();
        Some(format!("teacher {} exited ({status}){}", self.addr, log_tail(&self.log, 3)))
    }

    /// For a teacher taken over (no process here to watch its exit):
    /// whether it is time to ask it whether it still answers (at most once
    /// an `every`); the time is noted. Never for a teacher whose process is
    /// this coordinator's.
    pub fn look_due(&mut self, every: Duration) -> bool {
        if self.child.is_some() {
            return false;
        }
        let Some(c) = self.by_command.as_mut() else { return false };
        if c.looked.is_some_and(|t| t.elapsed() < every) {
            return false;
        }
        c.looked = Some(std::time::Instant::now());
        true
    }

    /// What asking it (as [`look_due`](Self::look_due) said to) found:
    /// after [`ADOPTED_MISSES`] looks in a row without an answer it is taken
    /// for gone: deregistered, and how is returned.
    pub fn looked(&mut self, answered: bool) -> Option<String> {
        let c = self.by_command.as_mut()?;
        c.misses = if answered { 0 } else { c.misses + 1 };
        if c.misses < ADOPTED_MISSES {
            return None;
        }
        self.deregister();
        Some(format!(
            "teacher {} (taken over) did not answer ready {ADOPTED_MISSES} times in a row",
            self.addr
        ))
    }

    /// Tells the process to stop (SIGTERM: it deregisters and drains);
    /// dropping it then waits for its exit. A teacher started by command
    /// is deregistered and given its stop command (`scancel --signal=TERM`,
    /// ...), and dropping it waits for its command to end, then signals its
    /// group; without a stop command its group gets SIGTERM now.
    pub fn ask_to_stop(&mut self) {
        self.deregister();
        if let Some(c) = self.by_command.as_mut()
            && let Some(line) = c.stop.take()
        {
            c.told = true;
            let mut cmd = Command::new("sh");
            cmd.arg("-c").arg(&line);
            match crate::process::output("the teacher stop command", &mut cmd, b"", Duration::from_secs(30)) {
                Ok(out) if out.status.success() => {}
                Ok(out) => tracing::warn!(
                    "teacher {}: the stop command {line:?} failed ({}): {}",
                    self.addr,
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
                Err(e) => tracing::warn!("teacher {}: the stop command {line:?}: {e:#}", self.addr),
            }
            return;
        }
        let Some(child) = self.child.as_mut() else { return };
        if let Some(c) = self.by_command.as_mut() {
            if !c.told && !std::mem::replace(&mut c.signalled, true) {
                signal_group(child, libc::SIGTERM);
            }
            return;
        }
        if let Ok(None) = child.try_wait() {
            // SAFETY: signalling our own child by pid; it is not reaped yet.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
    }

    /// Kills the process at once (as a crash would).
    pub fn kill(mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Copies a teacher's output to its log (`said`), sending its first line
/// (where it says where it serves) to `first`.
pub(crate) fn copy_output(
    stdout: std::process::ChildStdout,
    said: &mut std::fs::File,
    first: mpsc::Sender<String>,
) {
    use std::io::Write;
    let mut out = BufReader::new(stdout);
    let mut first = Some(first);
    loop {
        let mut line = Vec::new();
        match out.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let line = String::from_utf8_lossy(&line).trim_end().to_string();
        let _ = writeln!(said, "{line}");
        if let Some(tx) = first.take() {
            let _ = tx.send(line);
        }
    }
}

impl Drop for TeacherProcess {
    fn drop(&mut self) {
        if self.by_command.as_ref().is_some_and(|c| c.released) {
            return;
        }
        if self.by_command.is_some() {
            self.stop_group();
            return;
        }
        // Longer than its drain (1 s) and the requests it then finishes.
        if let Some(child) = self.child.as_mut() {
            terminate(child, Duration::from_secs(5));
        }
        // Its last words (what it served) reach its log.
        if let Some(copier) = self.copier.take() {
            let until = std::time::Instant::now() + Duration::from_secs(1);
            while !copier.is_finished() && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            if copier.is_finished() {
                let _ = copier.join();
            }
        }
    }
}

/// Sends `sig` to the process group `child` leads (whether or not the
/// leader is still there: what it started may be).
fn signal_group(child: &Child, sig: libc::c_int) {
    // SAFETY: the child was started as the leader of its own group; its id
    // names that group while any of the group lives (and a group left empty
    // gives ESRCH, ignored).
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), sig);
    }
}

impl TeacherProcess {
    /// Stops a teacher started by command: told (its stop command, or
    /// SIGTERM on its group), 5 s to end, then SIGTERM if it was told by its
    /// stop command only, 5 s more, then SIGKILL for whatever is left of
    /// its group.
    fn stop_group(&mut self) {
        self.ask_to_stop();
        // One taken over is its stop command's to end.
        let Some(child) = self.child.as_mut() else { return };
        let wait = |child: &mut Child, secs: u64| {
            let until = std::time::Instant::now() + Duration::from_secs(secs);
            while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        wait(child, 5);
        if let Some(c) = self.by_command.as_mut()
            && !std::mem::replace(&mut c.signalled, true)
        {
            signal_group(child, libc::SIGTERM);
            wait(child, 5);
        }
        signal_group(child, libc::SIGKILL);
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_teacher_taken_over_is_gone_after_looks_in_a_row_without_an_answer() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("teacher-0.log");
        let mut t = TeacherProcess::adopted("127.0.0.1:9", (0, 0, "true".into()), &log, None).unwrap();
        let mut ask = |answered: bool| {
            assert!(t.look_due(Duration::ZERO), "due when every look is");
            t.looked(answered)
        };
        assert_eq!(ask(false), None);
        assert_eq!(ask(false), None);
        // An answer starts the count again.
        assert_eq!(ask(true), None);
        assert_eq!(ask(false), None);
        assert_eq!(ask(false), None);
        let gone = ask(false).unwrap();
        assert!(gone.contains("127.0.0.1:9") && gone.contains("3 times in a row"), "{gone}");
        // Not asked again within `every`.
        assert!(t.look_due(Duration::ZERO) && !t.look_due(Duration::from_secs(3600)));
    }
}
