//! Captures of what crosses a namespace host's interface (tcpdump), read
//! back as the TCP payloads of each flow.

use super::{hosts::Hosts, wait::wait_for};
use std::{
    collections::HashMap,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

/// tcpdump's path; None (the test skips, saying so) where it is missing
/// outside CI.
pub(crate) fn tcpdump_or_skip() -> Option<&'static str> {
    let tcpdump = ["/usr/sbin/tcpdump", "/usr/bin/tcpdump"].into_iter().find(|p| Path::new(p).exists());
    if tcpdump.is_none() {
        assert!(std::env::var("CI").is_err(), "tcpdump is missing (.ci/run installs it)");
        eprintln!("skipped: tcpdump is missing (apt-get install tcpdump)");
    }
    tcpdump
}

/// tcpdump running on a host's eth0, writing into a test's directory.
pub(crate) struct Capture {
    dump: Child,
    file: PathBuf,
}

impl Capture {
    /// Starts capturing TCP on `host`'s eth0; returns once tcpdump listens.
    pub(crate) fn start(hosts: &Hosts, host: &str, tcpdump: &str, dir: &Path) -> Capture {
        let file = dir.join(format!("{host}.pcap"));
        let mut dump = hosts.on(host, tcpdump);
        dump.args(["-i", "eth0", "-U", "-s", "0", "-n", "-w"]).arg(&file).arg("tcp");
        let mut dump = dump.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let (tx, said) = std::sync::mpsc::channel();
        let stderr = BufReader::new(dump.stderr.take().unwrap());
        std::thread::spawn(move || stderr.lines().map_while(Result::ok).for_each(|l| drop(tx.send(l))));
        let mut seen = Vec::new();
        wait_for(&said, "listening on eth0", &mut seen, Duration::from_secs(30));
        Capture { dump, file }
    }

    /// Stops tcpdump (it writes out what it holds when told to stop) and
    /// reads the capture: TCP payloads by flow (source, destination).
    pub(crate) fn stop(mut self) -> HashMap<(String, String), Vec<u8>> {
        let _ = Command::new("kill").args(["-INT", &self.dump.id().to_string()]).status();
        let _ = self.dump.wait();
        tcp_payloads(&std::fs::read(&self.file).unwrap())
    }
}

pub(crate) fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// TCP payloads of a capture file, by flow (source, destination), in order.
/// The file is pcap (microsecond or nanosecond) over Ethernet, as tcpdump
/// writes for a veth interface.
pub(crate) fn tcp_payloads(pcap: &[u8]) -> HashMap<(String, String), Vec<u8>> {
    assert!(pcap.len() >= 24, "a capture file with its header");
    let magic = u32::from_le_bytes(pcap[0..4].try_into().unwrap());
    assert!(magic == 0xa1b2_c3d4 || magic == 0xa1b2_3c4d, "a little-endian pcap file: {magic:#x}");
    let link = u32::from_le_bytes(pcap[20..24].try_into().unwrap());
    assert_eq!(link, 1, "Ethernet frames");
    let mut flows: HashMap<(String, String), Vec<u8>> = HashMap::new();
    let mut at = 24;
    while at + 16 <= pcap.len() {
        let caught = u32::from_le_bytes(pcap[at + 8..at + 12].try_into().unwrap()) as usize;
        let frame = &pcap[at + 16..(at + 16 + caught).min(pcap.len())];
        at += 16 + caught;
        // Ethernet, IPv4, TCP.
        if frame.len() < 14 + 20 || frame[12..14] != [0x08, 0x00] {
            continue;
        }
        let ip = &frame[14..];
        let (ihl, total) = (((ip[0] & 0x0f) as usize) * 4, u16::from_be_bytes([ip[2], ip[3]]) as usize);
        if ip[9] != 6 || ip.len() < total.min(ip.len()) || total < ihl + 20 {
            continue;
        }
        let ip = &ip[..total.min(ip.len())];
        let tcp = &ip[ihl..];
        let data = ((tcp[12] >> 4) as usize) * 4;
        let port = |i: usize| u16::from_be_bytes([tcp[i], tcp[i + 1]]);
        let end = |a: &[u8], p: u16| format!("{}.{}.{}.{}:{p}", a[0], a[1], a[2], a[3]);
        let key = (end(&ip[12..16], port(0)), end(&ip[16..20], port(2)));
        if tcp.len() > data {
            flows.entry(key).or_default().extend_from_slice(&tcp[data..]);
        }
    }
    flows
}
