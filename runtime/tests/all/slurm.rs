//! A job on a real Slurm cluster built by the test: its own munged, a
//! slurmctld on one network-namespace host and a slurmd on each of three
//! more (Debian's slurm-wlm and munge, installed by the project's build
//! script and `.ci/run` when missing; as root).

use crate::support::{
    KillOnDrop,
    hosts::Hosts,
    job::{assert_exactly_once, finish, job, lines, report},
    wait::{until, wait_for},
};
use edl_plugin_artifacts as art;
use std::{
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A program of Slurm's or munge's, where Debian puts it.
fn sbin(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/usr/bin", "/sbin"].iter().map(|d| Path::new(d).join(name)).find(|p| p.exists())
}

/// A Slurm cluster: slurmctld on host `ctl`, a slurmd per node host.
struct Slurm<'h> {
    hosts: &'h Hosts,
    dir: tempfile::TempDir,
    conf: PathBuf,
    daemons: Vec<Child>,
}

impl<'h> Slurm<'h> {
    /// Starts it and waits until every node is idle; None (and why,
    /// printed) where Slurm is not installed, outside CI.
    fn start(hosts: &'h Hosts, nodes: &[&str]) -> Option<Slurm<'h>> {
        let (Some(munged), Some(ctld), Some(slurmd)) = (sbin("munged"), sbin("slurmctld"), sbin("slurmd"))
        else {
            assert!(
                std::env::var_os("CI").is_none(),
                "Slurm is missing (.ci/run installs slurm-wlm and munge)"
            );
            eprintln!("skipped: Slurm is missing (apt-get install slurm-wlm munge)");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // munge: a key of this cluster's own, a socket the daemons name.
        let key = d.join("munge.key");
        let mut bytes = vec![0u8; 1024];
        std::fs::File::open("/dev/urandom").unwrap().read_exact(&mut bytes).unwrap();
        std::fs::write(&key, &bytes).unwrap();
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o400)).unwrap();
        let socket = d.join("munge.sock");
        let mut daemons = Vec::new();
        let munge = Command::new(&munged)
            .args(["--foreground", "--force", "--key-file"])
            .arg(&key)
            .arg("--socket")
            .arg(&socket)
            .arg("--pid-file")
            .arg(d.join("munged.pid"))
            .arg("--log-file")
            .arg(d.join("munged.log"))
            .arg("--seed-file")
            .arg(d.join("munged.seed"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("munged");
        daemons.push(munge);
        let until = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            assert!(Instant::now() < until, "munged made no socket: {}", log(&d.join("munged.log")));
            std::thread::sleep(Duration::from_millis(50));
        }
        let p = |name: &str| d.join(name).display().to_string();
        let mut conf = format!(
            "ClusterName=edltest\nSlurmctldHost={me}({ctl})\nAuthType=auth/munge\nCredType=cred/munge\nMailProg=/bin/true\n\
             AuthInfo=socket={sock}\nSlurmUser=root\nSlurmdUser=root\nSlurmctldPort=6817\nSlurmdPort=6818\n\
             StateSaveLocation={state}\nSlurmdSpoolDir={spool}\nSlurmctldPidFile={ctldpid}\n\
             SlurmdPidFile={dpid}\nSlurmctldLogFile={ctldlog}\nSlurmdLogFile={dlog}\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\nSelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core\nReturnToService=2\nMpiDefault=none\nKillWait=30\nMinJobAge=600\n\
             SchedulerParameters=sched_interval=2\n",
            // The controller is this machine (the hosts share its name), at ctl's address.
            me = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim(),
            ctl = hosts.ip("ctl"),
            sock = socket.display(),
            state = p("state"),
            spool = p("spool-%n"),
            ctldpid = p("slurmctld.pid"),
            dpid = p("slurmd-%n.pid"),
            ctldlog = p("slurmctld.log"),
            dlog = p("slurmd-%n.log"),
        );
        for n in nodes {
            conf.push_str(&format!(
                "NodeName={n} NodeAddr={} CPUs=2 RealMemory=1000 State=UNKNOWN\n",
                hosts.ip(n)
            ));
        }
        conf.push_str(&format!(
            "PartitionName=edl Nodes={} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n",
            nodes.join(",")
        ));
        let conf_path = d.join("slurm.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let quiet = |mut c: Command| c.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let mut c = hosts.on("ctl", ctld.to_str().unwrap());
        c.args(["-D", "-i", "-f"]).arg(&conf_path);
        daemons.push(quiet(c));
        for n in nodes {
            std::fs::create_dir_all(d.join(format!("spool-{n}"))).unwrap();
            // Into the host's network only: `ip netns exec` would also mount
            // a sysfs of its own, without the cgroups slurmd looks for.
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/var/run/netns/{}", hosts.ns(n))).arg("--").arg(&slurmd);
            c.args(["-D", "-N", n, "-f"]).arg(&conf_path);
            daemons.push(quiet(c));
        }
        let s = Slurm { hosts, dir, conf: conf_path, daemons };
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let idle = s.run("sinfo", &["--noheader", "--states=idle", "--format=%D"]);
            if idle.trim().parse::<usize>().ok() == Some(nodes.len()) {
                break;
            }
            assert!(
                Instant::now() < until,
                "the Slurm nodes did not come up ({idle}; {}); slurmctld: {}\nslurmd on {}: {}",
                s.run("sinfo", &["--Node", "--long"]),
                log(&s.dir.path().join("slurmctld.log")),
                nodes[0],
                log(&s.dir.path().join(format!("slurmd-{}.log", nodes[0])))
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        Some(s)
    }

    /// A Slurm client command, on the controller's host.
    fn command(&self, program: &str) -> Command {
        let mut c = self.hosts.on("ctl", program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// The test job (`job(dir, flags)`) run from the controller's host in
    /// `dir`, its workers Slurm jobs of the partition, its coordinator
    /// listening there on `port`; its output piped.
    fn job(&self, dir: &Path, flags: &[&str], port: u16) -> Command {
        let cmd = job(dir, flags);
        let mut c = self.command(cmd.get_program().to_str().unwrap());
        c.args(cmd.get_args()).current_dir(dir);
        c.args(["--scaler", "slurm", "--slurm-partition", "edl"]);
        c.args(["--listen", &format!("{}:{port}", self.hosts.ip("ctl"))]);
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }

    /// Runs a Slurm client command; its output (stdout and stderr).
    fn run(&self, program: &str, args: &[&str]) -> String {
        let out = self.command(program).args(args).output().unwrap();
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }

    /// The queue: (job id, state, node, name) of every job.
    fn queue(&self) -> Vec<(String, String, String, String)> {
        self.run("squeue", &["--noheader", "--format=%i|%T|%N|%j"])
            .lines()
            .filter_map(|l| {
                let mut f = l.trim().split('|').map(str::to_string);
                Some((f.next()?, f.next()?, f.next()?, f.next()?))
            })
            .collect()
    }
}

impl Drop for Slurm<'_> {
    fn drop(&mut self) {
        for d in self.daemons.iter_mut().rev() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

fn log(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
}

#[test]
fn a_job_runs_on_slurm_grows_loses_a_node_has_a_worker_preempted_with_notice_and_leaves_nothing_queued() {
    let nodes = ["n1", "n2", "n3"];
    let Some(hosts) = Hosts::build_or_skip(&["ctl", "n1", "n2", "n3"]) else { return };
    let Some(slurm) = Slurm::start(&hosts, &nodes) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut c = slurm.job(d, &["--no-distill", "--teachers", "0", "--epochs", "20"], 7070);
    // The policy grows the job one worker every 8 steps to 3, then shrinks it.
    c.args(["--policy", art::SCHEDULE_WASM, "--policy-config", "every=8", "--decide-every-steps", "4"]);
    c.args(["--workers", "1", "--min-workers", "1", "--max-workers", "3", "--step-delay-ms", "40"]);
    c.args(["--slurm-pending-secs", "4"]);
    let mut child = c.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, " -> 3 workers", &mut seen, Duration::from_secs(180));

    // A worker preempted with notice: SIGTERM to its batch job. (One the
    // policy is removing at that moment hears nothing it could hand over:
    // another is tried.)
    let mut preempted = None;
    for _ in 0..5 {
        let mut victim = None;
        until("a running worker to preempt", Duration::from_secs(120), || {
            // Its Slurm job is named edl-<job>-<worker id>.
            victim = slurm
                .queue()
                .into_iter()
                .find(|(_, s, _, _)| s == "RUNNING")
                .map(|(id, _, _, name)| (id, name.rsplit('-').next().unwrap_or_default().to_string()));
            victim.is_some()
        });
        let (victim, id) = victim.unwrap();
        slurm.run("scancel", &["--batch", "--signal=TERM", &victim]);
        let told = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let needle = format!("worker {id} was told to go (SIGTERM on");
            wait_for(&rx, &needle, &mut seen, Duration::from_secs(20))
        }));
        if told.is_ok() {
            preempted = Some((victim, id));
            break;
        }
    }
    let (victim, preempted) = preempted.expect("a worker preempted with notice");
    wait_for(&rx, &format!("worker {preempted} left with notice"), &mut seen, Duration::from_secs(60));

    // A node set down: Slurm ends its jobs, with SIGTERM first, so the
    // workers there leave at a boundary; the job goes on.
    let mut downed = None;
    for _ in 0..5 {
        let mut node = None;
        until("a worker running on a node", Duration::from_secs(120), || {
            node = slurm
                .queue()
                .into_iter()
                .find(|(id, s, n, _)| *id != victim && s == "RUNNING" && !n.is_empty());
            node.is_some()
        });
        let (_, _, node, _) = node.unwrap();
        slurm.run("scontrol", &["update", &format!("nodename={node}"), "state=down", "reason=edl-test"]);
        let told = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_for(&rx, &format!("was told to go (SIGTERM on {node})"), &mut seen, Duration::from_secs(20))
        }));
        slurm.run("scontrol", &["update", &format!("nodename={node}"), "state=resume"]);
        if told.is_ok() {
            downed = Some(node);
            break;
        }
    }
    let node = downed.expect("a node set down under a worker");
    // A worker there that held the job's only state hands it to a
    // replacement on another node first, within Slurm's KillWait (or,
    // killed first, the job restarts from the checkpoint of its notice).
    let handed = format!("left with notice (SIGTERM on {node})");
    let end = Instant::now() + Duration::from_secs(90);
    let handed_over = loop {
        let line = rx.recv_timeout(end.saturating_duration_since(Instant::now()));
        let line = line.unwrap_or_else(|_| panic!("no handover nor restart:\n{}", seen.join("\n")));
        seen.push(line);
        let l = seen.last().unwrap();
        if l.contains(&handed) {
            break true;
        }
        if l.contains("restarting from step ") {
            break false;
        }
    };

    // The partition goes down: the workers the policy asks for meanwhile
    // stay pending, are cancelled after the bound and reported; the job
    // goes on with those it has.
    slurm.run("scontrol", &["update", "partitionname=edl", "state=down"]);
    wait_for(&rx, "Slurm did not start its job", &mut seen, Duration::from_secs(120));
    slurm.run("scontrol", &["update", "partitionname=edl", "state=up"]);

    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(d);
    assert_exactly_once(&r, 20, 1200);
    // The policy was told the room Slurm reports: idle nodes of the partition.
    let rooms: Vec<u32> = seen
        .iter()
        .filter_map(|l| l.split("the scheduler has room for ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert!(!rooms.is_empty() && rooms.iter().all(|n| *n <= 3), "{rooms:?}\n{text}");
    let events = r["scale_events"].as_array().unwrap();
    let reasons: Vec<&str> = events.iter().filter_map(|e| e["reason"].as_str()).collect();
    // Grown and shrunk by the policy.
    assert!(
        events.iter().any(|e| e["to"] == 3 && e["reason"].as_str().unwrap().starts_with("policy")),
        "{reasons:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["to"].as_u64() < e["from"].as_u64()
                && e["reason"].as_str().unwrap().starts_with("policy")),
        "{reasons:?}"
    );
    // The preempted worker left as a planned scale-in: its own event, and
    // it is not among the lost; so did those on the node set down.
    assert!(!handed_over || reasons.iter().any(|r| r.contains(&handed)), "{reasons:?}");
    let handles = r["worker_handles"].as_object().unwrap();
    assert_eq!(handles[&preempted].as_str(), Some(format!("slurm:{victim}").as_str()), "{handles:?}");
    let left = format!("worker {preempted} left with notice (SIGTERM on ");
    assert!(reasons.iter().any(|r| r.contains(&left)), "{reasons:?}\n{text}");
    assert!(!reasons.iter().any(|r| r.contains(&format!("worker {preempted} lost"))), "{reasons:?}");
    // Every worker was a Slurm job, and none is left in the queue.
    let started = r["workers_started"].as_array().unwrap();
    assert_eq!(handles.len(), started.len(), "{r}");
    until("the queue to empty", Duration::from_secs(30), || slurm.queue().is_empty());
}

#[test]
fn a_standby_coordinator_takes_a_slurm_job_over_with_its_workers_batch_jobs() {
    let nodes = ["n1", "n2"];
    let Some(hosts) = Hosts::build_or_skip(&["ctl", "n1", "n2"]) else { return };
    let Some(slurm) = Slurm::start(&hosts, &nodes) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let _redis = KillOnDrop(hosts.redis("ctl", d));
    let store = format!("redis://{}:6379/", hosts.ip("ctl"));
    // Two coordinators of one job on the controller's host, each with a
    // directory of its own; checkpoints and the secret are shared.
    let coordinator = |name: &str, port: u16, extra: &[&str]| {
        let cwd = d.join(name);
        std::fs::create_dir_all(&cwd).unwrap();
        let args = ["--no-distill", "--teachers", "0", "--store", &store, "--job", "sl", "--epochs", "12"];
        let mut c = slurm.job(&cwd, &args, port);
        c.args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"]);
        c.args(["--workers", "2", "--min-workers", "2", "--max-workers", "2", "--step-delay-ms", "40"]);
        c.args(["--checkpoint-every-steps", "20", "--checkpoint-dir"]).arg(d.join("checkpoints"));
        c.arg("--secret-file").arg(d.join("job.secret"));
        c.args(extra);
        c.spawn().unwrap()
    };
    let mut first = coordinator("a", 7070, &[]);
    let first_said = lines(&mut first);
    let mut seen_a = Vec::new();
    wait_for(&first_said, "epoch     1 done", &mut seen_a, Duration::from_secs(180));
    let mut standby = coordinator("b", 7071, &["--standby"]);
    let rx = lines(&mut standby);
    let mut seen = Vec::new();
    wait_for(&rx, "waiting to take it over", &mut seen, Duration::from_secs(120));
    let mut running: Vec<String> =
        slurm.queue().into_iter().filter(|(_, s, _, _)| s == "RUNNING").map(|(id, ..)| id).collect();
    running.sort();
    assert_eq!(running.len(), 2, "{:?}\n{}", slurm.queue(), seen_a.join("\n"));
    first.kill().unwrap();
    let _ = first.wait();
    wait_for(&rx, "taking job \"sl\" over", &mut seen, Duration::from_secs(120));
    let status = finish(standby, rx, &mut seen);
    let said = seen.join("\n");
    assert!(status.success(), "{said}");
    let r = report(&d.join("b"));
    assert_exactly_once(&r, 12, 1200);
    let events = r["scale_events"].as_array().unwrap();
    assert!(
        events.iter().any(|e| e["reason"].as_str().unwrap().contains("2 of its 2 workers came back")),
        "{events:?}"
    );
    // The batch jobs of the workers that came back are the standby's: it
    // names them, and no new one was submitted.
    let mut handles: Vec<String> = r["worker_handles"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(|h| h.as_str()?.strip_prefix("slurm:").map(String::from))
        .collect();
    handles.sort();
    assert_eq!(handles, running, "{r}");
    assert!(!said.contains("which this coordinator's scaler does not know"), "{said}");
    until("the queue to empty", Duration::from_secs(30), || slurm.queue().is_empty());
}

#[test]
fn the_job_s_teachers_run_as_slurm_steps_on_their_node_and_leave_nothing_queued() {
    let Some(hosts) = Hosts::build_or_skip(&["ctl", "n1"]) else { return };
    let Some(slurm) = Slurm::start(&hosts, &["n1"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cmd = job(d, &["--epochs", "2", "--job", "st"]);
    let mut c = slurm.command(cmd.get_program().to_str().unwrap());
    c.args(cmd.get_args()).current_dir(d).env("SLURM_CONF", &slurm.conf);
    // The teacher: a step on n1 (by its Slurm name), reached at n1's address.
    c.args([
        "--teacher-command",
        "srun -p edl -w {host} -N1 -n1 -J edl-teacher-{id} {exe} teacher --listen {addr}:{port} --model {model} --store memory",
        "--teacher-hosts",
        &format!("n1={}", hosts.ip("n1")),
        "--teacher-port",
        "8101",
        // Notice to the step itself (srun told to stop would kill it).
        "--teacher-stop-command",
        "scancel --signal=TERM --name edl-teacher-{id}",
    ]);
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let at = format!("teacher   0 serving on {}:8101", hosts.ip("n1"));
    wait_for(&rx, &at, &mut seen, Duration::from_secs(180));
    let running = slurm.queue();
    assert!(
        running
            .iter()
            .any(|(_, state, node, name)| name == "edl-teacher-0" && state == "RUNNING" && node == "n1"),
        "{running:?}"
    );
    let status = finish(child, rx, &mut seen);
    let said = seen.join("\n");
    assert!(status.success(), "{said}");
    assert_exactly_once(&report(d), 2, 1200);
    // It served the students' soft labels, and said so as it stopped.
    let log = std::fs::read_to_string(d.join(".edl/st/logs/teacher-0.log")).unwrap();
    let served =
        log.lines().find_map(|l| l.split(": served ").nth(1)?.split(' ').next()?.parse::<u64>().ok());
    assert!(served.is_some_and(|n| n >= 2 * 1200), "{log}");
    until("the teacher's step to leave the queue", Duration::from_secs(60), || slurm.queue().is_empty());
}

#[test]
fn the_job_s_parameter_servers_run_as_slurm_jobs_hand_their_shards_over_when_cancelled_and_none_stay_queued()
{
    let Some(hosts) = Hosts::build_or_skip(&["ctl", "n1", "n2"]) else { return };
    let Some(slurm) = Slurm::start(&hosts, &["n1", "n2"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The built-in CTR model: its worker a Slurm batch job, its three
    // servers (two replicas of each shard) Slurm jobs the job starts by srun.
    let mut c = slurm.command(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(d)
        .args(["--dataset", "ctr", "--train-samples", "6000", "--epochs", "2", "--job", "sp"])
        .args(["--ps-servers", "3", "--ps-replicas", "2", "--teachers", "0"])
        .args(["--workers", "1", "--min-workers", "1", "--max-workers", "1", "--step-delay-ms", "30"])
        .args([
            "--scaler",
            "slurm",
            "--slurm-partition",
            "edl",
            "--listen",
            &format!("{}:7070", hosts.ip("ctl")),
        ])
        .args(["--report", "report.json", "--plugin-cache"])
        .arg(d.join("plugin-cache"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "ps        3 serving on ", &mut seen, Duration::from_secs(180));
    // Each server a Slurm job of its own on a node, reached at that node's address.
    let nodes = [hosts.ip("n1").to_string(), hosts.ip("n2").to_string()];
    let queue = slurm.queue();
    for id in 1..=3 {
        let name = format!("edl-sp-ps-{id}");
        let job = queue.iter().find(|(_, _, _, n)| *n == name).unwrap_or_else(|| panic!("{name}: {queue:?}"));
        assert!(job.1 == "RUNNING" && (job.2 == "n1" || job.2 == "n2"), "{job:?}");
        let said = seen.iter().find(|l| l.starts_with(&format!("ps        {id} serving on "))).unwrap();
        let at = said.split("serving on ").nth(1).unwrap().split(':').next().unwrap();
        assert!(nodes.iter().any(|n| n == at), "server {id} at {at}, not a node's address: {said}");
    }
    wait_for(&rx, "0 -> 1 workers", &mut seen, Duration::from_secs(120));
    // Server 2's Slurm job cancelled mid-job (as preemption does): Slurm
    // gives it SIGTERM, its notice, and the job moves its shards to the
    // others while training goes on, then lets it go.
    let cancelled = slurm.run("scancel", &["--name", "edl-sp-ps-2"]);
    wait_for(&rx, "parameter server 2 was told to go", &mut seen, Duration::from_secs(120));
    let status = finish(child, rx, &mut seen);
    let said = seen.join("\n");
    assert!(status.success(), "{cancelled}\n{said}");
    assert!(said.contains("parameter servers 3 -> 2: ") && said.contains(" rows moved at step "), "{said}");
    assert_exactly_once(&report(d), 2, 6000);
    // The servers' jobs end with the job: nothing stays queued.
    until("the queue to empty", Duration::from_secs(60), || slurm.queue().is_empty());
}

/// Checks that each node running the job's (`rl`) workers runs one relay,
/// a batch job of the job's on that node; that the coordinator holds one
/// connection a node, the relay's; and that every worker there goes to its
/// relay. The relays' nodes.
fn through_relays(slurm: &Slurm, hosts: &Hosts) -> Vec<String> {
    let queue = slurm.queue();
    // The nodes of the running jobs whose name, past `edl-rl-`, `is` says.
    let nodes_of = |is: fn(&str) -> bool| -> Vec<String> {
        let mut on: Vec<String> = queue
            .iter()
            .filter(|(_, s, _, name)| s == "RUNNING" && name.strip_prefix("edl-rl-").is_some_and(is))
            .map(|(_, _, node, _)| node.clone())
            .collect();
        on.sort();
        on
    };
    let mut worker_nodes = nodes_of(|n| n.bytes().all(|b| b.is_ascii_digit()));
    let relays = nodes_of(|n| n.starts_with("relay-"));
    assert_eq!(worker_nodes.len(), 4, "{queue:?}");
    worker_nodes.dedup();
    assert_eq!(relays, worker_nodes, "one relay on each node with workers: {queue:?}");
    let ss =
        hosts.on("ctl", "ss").args(["-tnH", "state", "established", "( sport = :7070 )"]).output().unwrap();
    let text = String::from_utf8_lossy(&ss.stdout).into_owned();
    let peers: Vec<&str> = text.lines().filter_map(|l| l.split_whitespace().last()).collect();
    assert_eq!(peers.len(), relays.len(), "one connection a node: {text}\n{queue:?}");
    for node in &relays {
        assert!(peers.iter().any(|p| p.starts_with(&format!("{}:", hosts.ip(node)))), "{node}: {text}");
        let procs = hosts.command_lines(node);
        let workers: Vec<_> = procs.iter().filter(|(_, c)| c.contains(" worker ")).collect();
        assert!(!workers.is_empty(), "{node}: {procs:?}");
        for (_, w) in workers {
            assert!(w.contains("--coordinator 127.0.0.1:"), "a worker on {node} goes to its relay: {w}");
        }
    }
    relays
}

#[test]
fn with_relay_each_node_s_workers_reach_the_job_through_a_relay_job_there_whose_loss_is_the_node_s() {
    let nodes = ["n1", "n2"];
    let Some(hosts) = Hosts::build_or_skip(&["ctl", "n1", "n2"]) else { return };
    let Some(slurm) = Slurm::start(&hosts, &nodes) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut c = slurm.job(d, &["--no-distill", "--teachers", "0", "--epochs", "8", "--job", "rl"], 7070);
    c.args(["--relay", "--policy", art::AUTOSCALE_WASM, "--decide-every", "100000"]);
    c.args(["--workers", "4", "--min-workers", "4", "--max-workers", "4", "--step-delay-ms", "20"]);
    c.args(["--checkpoint-every-steps", "10", "--collective-timeout-ms", "60000"]);
    let mut child = c.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(180));

    let relays = through_relays(&slurm, &hosts);

    // A relay killed: its node's workers are lost with it, and those
    // started in their place reach the job through a relay as well (a new
    // one where they run on that node again).
    let node = &relays[0];
    let relay = hosts.command_lines(node).into_iter().find(|(_, c)| c.contains(" relay ")).expect("a relay");
    let lost = hosts.command_lines(node).iter().filter(|(_, c)| c.contains(" worker ")).count();
    crate::support::process::sigkill(u32::try_from(relay.0).expect("a process id"));
    // Back to 4, their replacements joining at one boundary or at several
    // (as each is ready).
    wait_for(&rx, " -> 4 workers", &mut seen, Duration::from_secs(180));
    through_relays(&slurm, &hosts);
    let status = finish(child, rx, &mut seen);
    let said = seen.join("\n");
    assert!(status.success(), "{said}");
    let r = report(d);
    assert_exactly_once(&r, 8, 1200);
    // The node's workers were lost together, the loss naming the relay.
    let events = r["scale_events"].as_array().unwrap();
    assert!(
        events.iter().any(|e| {
            let reason = e["reason"].as_str().unwrap_or("");
            e["from"].as_u64() == Some(4)
                && e["to"].as_u64() == Some(4 - lost as u64)
                && reason.matches(" lost").count() == lost
        }),
        "{lost} workers lost with the relay: {events:?}"
    );
    let failed = seen.iter().find(|l| l.contains("relay at") && l.contains("was lost: ")).expect("the loss");
    // Their processes were stopped as they were lost, so the survivors'
    // collectives ended then, not at their timeout (a minute here).
    assert!(!failed.contains("timed out"), "{failed}");
    assert_eq!(r["final_world_size"].as_u64(), Some(4), "{r}");
    // Relays and workers alike leave nothing queued.
    until("the queue to empty", Duration::from_secs(30), || slurm.queue().is_empty());
}

#[test]
fn a_frozen_worker_s_slurm_job_is_killed_once_its_lease_lapses_and_the_other_does_not_wait_out_its_collective()
 {
    let nodes = ["n1", "n2"];
    let Some(hosts) = Hosts::build_or_skip(&["ctl", "n1", "n2"]) else { return };
    let Some(slurm) = Slurm::start(&hosts, &nodes) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut c = slurm.job(d, &["--no-distill", "--teachers", "0", "--epochs", "8"], 7070);
    c.args(["--policy", art::AUTOSCALE_WASM, "--decide-every", "100000"]);
    c.args(["--workers", "2", "--min-workers", "1", "--max-workers", "2", "--step-delay-ms", "20"]);
    // The collectives' bound (60 s) far past the lease (3 s).
    c.args(["--collective-timeout-ms", "60000", "--worker-lease-secs", "3"]);
    let mut child = c.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     1 done", &mut seen, Duration::from_secs(180));
    // Frozen: SIGSTOP to a worker's batch step (the worker itself).
    let running = slurm.queue();
    let (victim, id) = running
        .iter()
        .find(|(_, s, _, name)| s == "RUNNING" && name.starts_with("edl-"))
        .map(|(j, _, _, name)| (j.clone(), name.rsplit('-').next().unwrap_or_default().to_string()))
        .unwrap_or_else(|| panic!("a running worker: {running:?}"));
    slurm.run("scancel", &["--batch", "--signal=STOP", &victim]);
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(d);
    assert_exactly_once(&r, 8, 1200);
    assert!(text.contains("no heartbeat for"), "its lease lapsed: {text}");
    let killed = format!(
        "worker {id} went silent for its lease and still ran a second later: its Slurm job {victim} killed"
    );
    assert!(text.contains(&killed), "{text}");
    // Its processes gone, the other's collective failed on its closed
    // sockets: none waited for the 60 s bound.
    assert!(!text.contains("timed out"), "{text}");
    let reasons: Vec<&str> =
        r["scale_events"].as_array().unwrap().iter().filter_map(|e| e["reason"].as_str()).collect();
    assert!(reasons.iter().any(|r| r.contains(&format!("worker {id} lost"))), "{reasons:?}");
    until("the queue to empty", Duration::from_secs(30), || slurm.queue().is_empty());
}
