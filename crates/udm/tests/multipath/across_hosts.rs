//! Hosts A, B and C as network namespaces: fio on A through a multipath over B's and C's
//! exports while servers are killed, links cut and both paths gone; a clone hydrating from it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::*;

const SIZE: u64 = 64 * MIB;

/// One lab at a time: each runs three daemons and fio, on a machine of two cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// Hosts A, B and C. Fields drop in order: the daemons before the namespaces they run in.
struct Lab {
    a: Daemon,
    /// B and C.
    servers: [Daemon; 2],
    disk: PathBuf,
    _scratch: TempDir,
    /// A, B, C.
    hosts: [Netns; 3],
}

/// A's interface towards B and C.
const LINKS: [&str; 2] = ["to-b", "to-c"];

fn server_address(i: usize) -> String {
    format!("10.77.{}.2", i + 1)
}

/// The export of B (0) or C (1), as A's table names it.
fn path_uri(i: usize) -> String {
    format!("nbd://{}:10809/vol", server_address(i))
}

impl Lab {
    /// The lab, or `None` (with a SKIPPED line) where namespaces cannot be made.
    fn new(tag: &str) -> Option<Lab> {
        let hosts = match ["a", "b", "c"].map(|h| Netns::new(&format!("{tag}-{h}"))) {
            [Ok(a), Ok(b), Ok(c)] => [a, b, c],
            [a, b, c] => {
                let why = [a.err(), b.err(), c.err()].into_iter().flatten().next();
                eprintln!("SKIPPED: {tag}: network namespaces cannot be created here: {why:?}");
                return None;
            }
        };
        for (i, link) in LINKS.iter().enumerate() {
            let net = i + 1;
            hosts[0]
                .link(
                    (link, &format!("10.77.{net}.1/24")),
                    &hosts[i + 1],
                    ("to-a", &format!("10.77.{net}.2/24")),
                )
                .unwrap();
        }
        let scratch = TempDir::new(&format!("mp-{tag}"));
        let disk = scratch.path("disk.img");
        pattern_file(&disk, SIZE as usize, 41);
        let servers = [0, 1].map(|i| {
            let listen = format!("tcp:{}:10809", server_address(i));
            let server =
                Daemon::start_in(&hosts[i + 1], &format!("mp-{tag}-{i}"), &["--nbd", &listen]);
            let table = format!("0 {} linear {} 0", SIZE / 512, disk.display());
            server.udm(&["create", "vol", "--table", &table]);
            server
        });
        let a = Daemon::start_in(&hosts[0], &format!("mp-{tag}-a"), &[]);
        Some(Lab {
            a,
            servers,
            disk,
            _scratch: scratch,
            hosts,
        })
    }

    /// `mp` on A: round-robin over B's and C's exports, with these features.
    fn multipath(&self, features: &[&str]) {
        let [b, c] = [0, 1].map(path_uri);
        self.multipath_with(features, &format!("1 1 round-robin 0 2 1 {b} 1 {c} 1"));
    }

    /// `mp` on A with these features and `groups` (`<#groups> <initial group> …`).
    fn multipath_with(&self, features: &[&str], groups: &str) {
        let table = format!(
            "0 {} multipath {} {} 0 {groups}",
            SIZE / 512,
            features.len(),
            features.join(" "),
        );
        self.a.udm(&["create", "mp", "--table", &table]);
    }

    fn status(&self) -> String {
        self.a.udm(&["status", "mp"])
    }

    /// Waits until A's status line of `mp` satisfies `ready`.
    fn wait_status(&self, what: &str, ready: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status = self.status();
            if ready(&status) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting until {what}: {status}\nA's log:\n{}",
                self.a.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self, server: usize) {
        self.servers[server].stop(libc::SIGKILL);
    }

    fn restart(&mut self, server: usize) {
        self.servers[server].launch();
    }

    fn cut(&self, server: usize, cut: bool) {
        self.hosts[0].set_link(LINKS[server], !cut).unwrap();
    }

    /// Cuts the link at the server's end, with A knowing the server's hardware address for
    /// good: A's route and neighbour entry stay, so what A sends is lost on the way, as
    /// across a router whose far side failed (A's connection attempts then wait for an
    /// answer, where a route gone, or a neighbour that does not answer, fails them at once).
    fn cut_far(&self, server: usize, cut: bool) {
        let host = &self.hosts[server + 1];
        if cut {
            let out = Command::new("ip")
                .args(["-n", host.name(), "-br", "link", "show", "to-a"])
                .output()
                .unwrap();
            let line = String::from_utf8_lossy(&out.stdout).into_owned();
            let mac = line.split_whitespace().nth(2).expect("a hardware address");
            self.hosts[0]
                .ip(&[
                    "neigh",
                    "replace",
                    &server_address(server),
                    "lladdr",
                    mac,
                    "dev",
                    LINKS[server],
                    "nud",
                    "permanent",
                ])
                .unwrap();
        }
        host.set_link("to-a", !cut).unwrap();
    }

    /// fio on A: 4 KiB random writes over the first 32 MiB at 2000 IOPS (about 4 s), then
    /// every block read back and checked.
    fn fio(&self) -> Child {
        Command::new("fio")
            .args([
                "--name=mp",
                "--ioengine=nbd",
                &format!("--uri={}", self.a.uri("mp")),
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=16",
                "--size=32M",
                "--rate_iops=2000",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--verify_state_save=0",
                "--output-format=json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("fio")
    }
}

/// fio's outcome: every write done and verified, no error. Returns the longest write
/// completion latency, in ms.
fn fio_verified(fio: Child, lab: &Lab) -> f64 {
    let out = fio.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio failed: {stdout}{}\nA's log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        lab.a.log()
    );
    let json: serde_json::Value =
        serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "{stdout}");
    assert_eq!(
        job["write"]["io_bytes"].as_u64().unwrap(),
        32 * MIB,
        "{stdout}"
    );
    // The verify pass read every block back.
    assert_eq!(
        job["read"]["io_bytes"].as_u64().unwrap(),
        32 * MIB,
        "{stdout}"
    );
    job["write"]["clat_ns"]["max"].as_f64().unwrap() / 1e6
}

/// The failed count and state of B's path in the status line.
fn path_state(status: &str, server: usize) -> String {
    super::path_state(status, &path_uri(server))
}

#[test]
fn fio_verifies_every_write_while_a_server_is_killed_and_restarted() {
    let _serial = SERIAL.lock();
    let Some(mut lab) = Lab::new("kill") else {
        return;
    };
    lab.multipath(&["checker_interval", "1"]);
    let fio = lab.fio();
    std::thread::sleep(Duration::from_millis(1500));
    lab.kill(0);
    lab.wait_status("B's path fails", |s| path_state(s, 0) == "F 1");
    std::thread::sleep(Duration::from_millis(1000));
    lab.restart(0);
    lab.wait_status("the checker reinstates B's path", |s| {
        path_state(s, 0) == "A 1"
    });
    let gap = fio_verified(fio, &lab);
    eprintln!("longest write while B was killed: {gap:.1} ms");
    assert_eq!(path_state(&lab.status(), 1), "A 0");
    // Both paths served writes: B's writes reached the disk before it died.
    assert!(lab
        .a
        .log()
        .contains("failing path nbd://10.77.1.2:10809/vol"));
}

#[test]
fn fio_verifies_every_write_while_a_link_is_cut() {
    let _serial = SERIAL.lock();
    let Some(lab) = Lab::new("cut") else {
        return;
    };
    lab.multipath(&["checker_interval", "1", "path_timeout", "2"]);
    let fio = lab.fio();
    std::thread::sleep(Duration::from_millis(1500));
    let cut = Instant::now();
    lab.cut(0, true);
    // No reset arrives: only the path timeout tells the path is gone.
    lab.wait_status("B's path fails", |s| path_state(s, 0) == "F 1");
    let noticed = cut.elapsed();
    assert!(
        noticed >= Duration::from_millis(1500) && noticed < Duration::from_secs(6),
        "B's path failed {noticed:?} after the cut"
    );
    std::thread::sleep(Duration::from_millis(500));
    lab.cut(0, false);
    lab.wait_status("the checker reinstates B's path", |s| {
        path_state(s, 0) == "A 1"
    });
    let gap = fio_verified(fio, &lab);
    eprintln!("B's path failed {noticed:?} after the cut; longest write {gap:.1} ms");
    assert!(gap < 4000.0, "a write waited {gap} ms");
}

/// After a long outage the checker reinstated a path about 10 s after its link returned
/// (`checker_interval 1`), past the documented checker interval plus at most 5 s of redial
/// backoff: across a cut link a redial's connect waits for its SYNs to be answered (sent 0,
/// 1, 3 and 7 s in) up to the 10 s connect timeout, and only then did the 5 s backoff
/// start, so for up to 8 s no SYN went out. Attempts now start at most 5 s apart, each
/// connect bounded by that.
///
/// The return is timed where it hurt: the backoff is first driven to its ceiling with the
/// link cut at A's end (no route: each attempt fails at once), then the link is cut at B's
/// end instead (A's SYNs are lost), and it returns half a second after an attempt gave up
/// waiting (A's log says when). The old client then slept 5 s before its next SYN.
#[test]
fn a_path_is_reinstated_within_the_backoff_after_a_long_outage() {
    let _serial = SERIAL.lock();
    let Some(lab) = Lab::new("outage") else {
        return;
    };
    lab.multipath(&["checker_interval", "1", "path_timeout", "1"]);
    let attempts = |log: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains("nbd: reconnect attempt"))
            .map(String::from)
            .collect()
    };
    lab.cut(0, true);
    lab.wait_status("B's path fails", |s| path_state(s, 0) == "F 1");
    // 0.1 + 0.2 + … + 3.2 s: the seventh failure leaves the backoff at 5 s.
    wait_for(|| attempts(&lab.a.log()).len() >= 7, "seven failed redials");
    lab.cut_far(0, true);
    lab.cut(0, false);
    let before = attempts(&lab.a.log()).len();
    let deadline = Instant::now() + Duration::from_secs(40);
    while !attempts(&lab.a.log())[before..]
        .iter()
        .any(|a| a.contains("timed out"))
    {
        assert!(
            Instant::now() < deadline,
            "no redial timed out:\n{}",
            lab.a.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let back = Instant::now();
    lab.cut_far(0, false);
    lab.wait_status("the checker reinstates B's path", |s| {
        path_state(s, 0) == "A 1"
    });
    let took = back.elapsed();
    eprintln!("B's path reinstated {took:?} after its link returned");
    // The SYN retransmitted a second into the next attempt, then a checker interval.
    assert!(
        took < Duration::from_secs(3),
        "B's path reinstated {took:?} after its link returned"
    );
}

#[test]
fn with_both_servers_gone_io_queues_and_resumes_when_one_returns() {
    let _serial = SERIAL.lock();
    let Some(mut lab) = Lab::new("queue") else {
        return;
    };
    lab.multipath(&["queue_if_no_path", "checker_interval", "1"]);
    let mut fio = lab.fio();
    std::thread::sleep(Duration::from_millis(1000));
    lab.kill(0);
    lab.kill(1);
    lab.wait_status("requests wait for a path", |s| s.contains("multipath 2 1 "));
    std::thread::sleep(Duration::from_millis(2000));
    assert!(
        fio.try_wait().unwrap().is_none(),
        "fio ended while no path was there"
    );
    lab.restart(1);
    lab.wait_status("C's path is back", |s| path_state(s, 1).starts_with('A'));
    fio_verified(fio, &lab);
    assert!(lab.status().contains("multipath 2 0 "));
}

#[test]
fn with_both_servers_gone_no_path_retry_fails_io_after_its_bound() {
    let _serial = SERIAL.lock();
    let Some(mut lab) = Lab::new("retry") else {
        return;
    };
    lab.multipath(&[
        "queue_if_no_path",
        "no_path_retry",
        "2",
        "checker_interval",
        "1",
    ]);
    let uri = lab.a.uri("mp");
    let (ok, out) = qemu_io(&uri, "read -P 0 0 4k");
    assert!(!ok, "the disk holds a pattern, not zeroes: {out}");
    lab.kill(0);
    lab.kill(1);
    let started = Instant::now();
    let (ok, out) = qemu_io(&uri, "read 1M 4k");
    let took = started.elapsed();
    assert!(!ok && out.contains("Input/output error"), "{out}");
    // Two checker intervals after the last path failed (the read failed both first).
    assert!(
        took >= Duration::from_millis(1800) && took < Duration::from_secs(6),
        "failed after {took:?}"
    );
    // Past the bound, requests fail at once until a path is back.
    let started = Instant::now();
    let (ok, _) = qemu_io(&uri, "read 2M 4k");
    assert!(!ok && started.elapsed() < Duration::from_millis(1500));
    lab.restart(0);
    lab.wait_status("B's path is back", |s| path_state(s, 0).starts_with('A'));
    let (ok, out) = qemu_io(&uri, "read 1M 4k");
    assert!(ok, "{out}");
}

#[test]
fn a_clone_hydrating_from_the_multipath_completes_when_a_server_is_killed() {
    let _serial = SERIAL.lock();
    let Some(mut lab) = Lab::new("clone") else {
        return;
    };
    lab.multipath(&[]);
    let (meta, dest) = (
        lab.a.sparse("meta.img", MIB),
        lab.a.sparse("dest.img", SIZE),
    );
    // 16 MiB/s: four seconds to copy, so B dies mid-way.
    let table = format!(
        "0 {} clone {} {} mp 128 0 2 max_hydration_rate 16384",
        SIZE / 512,
        meta.display(),
        dest.display()
    );
    lab.a.udm(&["create", "vol", "--table", &table]);
    std::thread::sleep(Duration::from_millis(1500));
    let progress = lab.a.udm(&["status", "vol", "--json"]);
    lab.kill(0);
    let out = lab.a.udm(&["wait", "vol", "--progress"]);
    assert!(out.ends_with("hydration complete"), "{out}");
    assert!(
        !progress.contains("\"complete\": true") && !progress.contains("\"complete\":true"),
        "hydration was over before B was killed: {progress}"
    );
    assert_eq!(path_state(&lab.status(), 0), "F 1");
    assert!(std::fs::read(&dest).unwrap() == std::fs::read(&lab.disk).unwrap());
}

#[test]
fn a_write_abandoned_on_a_cut_link_does_not_land_when_the_link_returns() {
    let _serial = SERIAL.lock();
    let Some(lab) = Lab::new("stale") else {
        return;
    };
    // B's group first, C's second: I/O goes to B while it answers.
    let [b, c] = [0, 1].map(path_uri);
    lab.multipath_with(
        &["checker_interval", "1", "path_timeout", "1"],
        &format!("2 1 round-robin 0 1 1 {b} 1 round-robin 0 1 1 {c} 1"),
    );
    let mut client = RawClient::connect(&lab.a.nbd_socket(), "mp");
    let write = |client: &mut RawClient, cookie: u64, byte: u8| {
        client.send(0, NBD_CMD_WRITE, cookie, 0, 4096, &[byte; 4096]);
        assert_eq!(client.reply().unwrap(), (0, cookie));
    };
    write(&mut client, 1, 0x11);
    lab.cut(0, true);
    // Stuck on B's path until its timeout, then done down C's.
    write(&mut client, 2, 0x22);
    assert_eq!(path_state(&lab.status(), 0), "F 1");
    write(&mut client, 3, 0x33);
    lab.cut(0, false);
    lab.wait_status("the checker reinstates B's path", |s| {
        path_state(s, 0) == "A 1"
    });
    // Long enough for TCP to retransmit whatever B's old connection still had to send.
    std::thread::sleep(Duration::from_secs(5));
    let mut block = vec![0u8; 4096];
    use std::os::unix::fs::FileExt;
    std::fs::File::open(&lab.disk)
        .unwrap()
        .read_exact_at(&mut block, 0)
        .unwrap();
    assert!(
        block.iter().all(|&b| b == 0x33),
        "block 0 holds {:#x}: a write abandoned on the cut link landed after the one that \
         replaced it",
        block[0]
    );
}
