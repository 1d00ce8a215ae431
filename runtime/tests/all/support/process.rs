//! Processes: a command's output, a running job's processes read from
//! /proc, and signals to them.

use std::process::Command;

/// Runs `cmd` to its end: its stdout and stderr, or (when it cannot start
/// or fails) an error naming `what`.
pub(crate) fn output_of(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(format!("{what} failed ({}):\n{text}", out.status));
    }
    Ok(text)
}

/// Every process: its id, its parent's and its command line (one reading
/// of /proc).
fn processes() -> Vec<(u32, u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        // Fields after the command name (which is in parentheses): state, ppid, ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r.to_string()) else { continue };
        let ppid: u32 = rest.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
        let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
        out.push((p, ppid, String::from_utf8_lossy(&cmd).replace('\0', " ")));
    }
    out
}

/// Processes whose parent is `pid`, with their command lines.
pub(crate) fn children(pid: u32) -> Vec<(u32, String)> {
    processes().into_iter().filter(|(_, ppid, _)| *ppid == pid).map(|(p, _, cmd)| (p, cmd)).collect()
}

/// Processes below `pid` (its children first, then theirs, and so on),
/// from one reading of /proc.
pub(crate) fn descendants(pid: u32) -> Vec<(u32, String)> {
    let all = processes();
    let mut found: Vec<(u32, String)> = Vec::new();
    let mut parents = vec![pid];
    while !parents.is_empty() {
        let below: Vec<(u32, String)> = all
            .iter()
            .filter(|(_, ppid, _)| parents.contains(ppid))
            .map(|(p, _, cmd)| (*p, cmd.clone()))
            .collect();
        parents = below.iter().map(|(p, _)| *p).collect();
        found.extend(below);
    }
    found
}

/// The worker id a launched program was given.
fn worker_id(pid: u32) -> Option<u64> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let launched = env
        .split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"EDL_WORKER_ID="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok());
    // The built-in job's workers: `edl-runtime worker ... --id N`.
    let builtin = || {
        let argv = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let argv: Vec<&[u8]> = argv.split(|&b| b == 0).collect();
        if !argv.contains(&&b"worker"[..]) {
            return None;
        }
        let at = argv.iter().position(|a| *a == b"--id")?;
        std::str::from_utf8(argv.get(at + 1)?).ok()?.parse().ok()
    };
    launched.or_else(builtin)
}

/// Sends SIGKILL to worker `id`, a child of the job `coordinator`
/// (panics, naming the children, when it has none of that id).
pub(crate) fn sigkill_worker(coordinator: u32, id: u64) {
    signal_worker(coordinator, id, libc::SIGKILL);
}

/// Sends `sig` to worker `id`, a child of the job `coordinator` (panics,
/// naming the children, when it has none of that id).
pub(crate) fn signal_worker(coordinator: u32, id: u64, sig: libc::c_int) {
    let victim = worker_pid(coordinator, id);
    let pid = libc::pid_t::try_from(victim).expect("a process id fits pid_t");
    // SAFETY: kill(2) takes plain integers and touches no memory of ours;
    // `victim` was just read as a running child of the job.
    unsafe { libc::kill(pid, sig) };
}

/// The process of worker `id`, a child of the job `coordinator` (panics,
/// naming the children, when it has none of that id).
pub(crate) fn worker_pid(coordinator: u32, id: u64) -> u32 {
    // A child, or a command's child (`sh -c` under `--scaler command`,
    // whose shell has the worker's environment too).
    let shell = |cmd: &str| cmd.starts_with("sh -c ") || cmd.starts_with("/bin/sh -c ");
    descendants(coordinator)
        .into_iter()
        .find(|(p, cmd)| worker_id(*p) == Some(id) && !shell(cmd))
        .unwrap_or_else(|| panic!("worker {id} among {:?}", descendants(coordinator)))
        .0
}

/// Sends SIGKILL to process `pid`.
pub(crate) fn sigkill(pid: u32) {
    let pid = libc::pid_t::try_from(pid).expect("a process id fits pid_t");
    // SAFETY: kill(2) takes plain integers and touches no memory of ours;
    // the tests signal only processes of the job they started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// Whether process `pid` runs (a zombie left to a parent that is gone does not).
pub(crate) fn runs(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// Established TCP connections whose local port is `port` (the accepted
/// ones of a listener on it), from /proc/net/tcp.
pub fn accepted_on(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            local_port == Some(port) && f[3] == "01"
        })
        .count()
}
