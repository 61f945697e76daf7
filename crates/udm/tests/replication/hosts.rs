//! Two hosts joined by a veth link: ext4 changes replicated round after round, and a transfer
//! cut mid-stream that resumes where the receiver stopped.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::*;

/// Two hosts, A (sending) and B (receiving, with a --replication listener), each with a pool;
/// A's thin device 1 is `vol`, served also as a file of A's FUSE mount.
struct Hosts {
    a: Daemon,
    b: Daemon,
    a_pool: Pool,
    b_pool: Pool,
    hosts: [Netns; 2],
}

impl Hosts {
    fn new(tag: &str) -> Option<Hosts> {
        let hosts = match [
            Netns::new(&format!("{tag}-a")),
            Netns::new(&format!("{tag}-b")),
        ] {
            [Ok(a), Ok(b)] => [a, b],
            [a, b] => {
                eprintln!(
                    "SKIPPED: {tag}: network namespaces cannot be created here: {:?}",
                    a.err().or(b.err())
                );
                return None;
            }
        };
        hosts[0]
            .link(
                ("to-b", "10.78.0.1/24"),
                &hosts[1],
                ("to-a", &format!("{B_ADDRESS}/24")),
            )
            .unwrap();
        let a = Daemon::start_in(
            &hosts[0],
            &format!("repl-{tag}-a"),
            &["--fuse", "{dir}/fuse"],
        );
        let listen = format!("tcp:{B_ADDRESS}:{B_PORT}");
        let b = Daemon::start_in(
            &hosts[1],
            &format!("repl-{tag}-b"),
            &["--replication", &listen],
        );
        let a_pool = make_pool(&a);
        let b_pool = make_pool(&b);
        a.udm(&["message", "pool", "0", "create_thin", "1"]);
        let table = format!("0 {} thin pool 1", VOLUME / 512);
        a.udm(&["create", "vol", "--table", &table]);
        Some(Hosts {
            a,
            b,
            a_pool,
            b_pool,
            hosts,
        })
    }

    /// `vol` as a file, seen from outside A's namespaces (its FUSE mount is in A's own mount
    /// namespace, which `ip netns exec` made).
    fn volume_file(&self) -> PathBuf {
        let mount = self.a.dir.path("fuse/vol");
        PathBuf::from(format!("/proc/{}/root{}", self.a.pid(), mount.display()))
    }

    /// `udm send` of A's snapshot `id` (from `from`) to B's listener, run on A.
    fn send(&self, id: u32, from: Option<u32>, extra: &[&str]) -> Command {
        let to = format!("tcp:{B_ADDRESS}:{B_PORT}/pool");
        let id = id.to_string();
        let from = from.map(|f| f.to_string());
        let mut args = vec!["send", "pool", &id, "--to", &to, "--json"];
        if let Some(from) = &from {
            args.extend(["--from", from]);
        }
        args.extend(extra);
        udm_in(&self.hosts[0], &self.a, &args)
    }
}

/// debugfs commands run on the volume (an ext4 filesystem), then synced through.
fn debugfs(volume: &Path, commands: &str) {
    let script = std::env::temp_dir().join(format!("udm-repl-debugfs-{}", std::process::id()));
    std::fs::write(&script, commands).unwrap();
    tool(
        "debugfs",
        &[
            "-w",
            "-f",
            script.to_str().unwrap(),
            volume.to_str().unwrap(),
        ],
    );
    tool("sync", &[volume.to_str().unwrap()]);
    std::fs::remove_file(script).unwrap();
}

#[test]
fn ten_rounds_of_ext4_changes_replicate_incrementally_to_another_host() {
    let Some(h) = Hosts::new("rounds") else {
        return;
    };
    let volume = h.volume_file();
    tool(
        "mkfs.ext4",
        &["-q", "-F", "-E", "nodiscard", volume.to_str().unwrap()],
    );
    tool("sync", &[volume.to_str().unwrap()]);
    let files = h.a.dir.path("files");
    std::fs::create_dir_all(&files).unwrap();
    let mut rng = udm_testkit::Rng::new(14);
    let mut previous = None;
    for round in 0..10u32 {
        // Change files: new ones, one overwritten, one removed.
        let mut commands = String::new();
        for f in 0..3 {
            let path = files.join(format!("r{round}-{f}"));
            let size = ((1 + rng.below(6)) * MIB / 2) as usize;
            let mut data = vec![0u8; size];
            rng.fill(&mut data);
            std::fs::write(&path, &data).unwrap();
            commands += &format!("write {} r{round}-{f}\n", path.display());
        }
        if round > 0 {
            commands += &format!("rm r{}-0\n", round - 1);
            commands += &format!("rm r{}-1\n", round - 1);
            commands += &format!(
                "write {} r{}-1\n",
                files.join(format!("r{round}-2")).display(),
                round - 1
            );
        }
        debugfs(&volume, &commands);
        let id = 10 + round;
        snapshot(&h.a, id);
        let summary = succeeded(h.send(id, previous, &[]).output().unwrap(), "send");
        assert_eq!(summary["received"]["snapshot"], id, "{summary}");
        let changed = summary["sent"]["changed_bytes"].as_u64().unwrap();
        if previous.is_some() {
            // Incremental: a few MiB of files and their metadata, not the filesystem.
            assert!(changed < 24 * MIB, "round {round}: {changed} bytes sent");
        }
        same_snapshot(&h.a, &h.b, id);
        fsck(&h.b, id);
        previous = Some(id);
    }
    thin_check(&h.a, &h.a_pool);
    thin_check(&h.b, &h.b_pool);
}

#[test]
fn a_transfer_cut_mid_stream_resumes_where_the_receiver_stopped() {
    let Some(h) = Hosts::new("cut") else {
        return;
    };
    // A slow link, so that the transfer is surely cut in the middle.
    let tc = [
        "qdisc", "add", "dev", "to-b", "root", "tbf", "rate", "200mbit", "burst", "64kb",
        "latency", "100ms",
    ];
    run_ok(
        Command::new("ip")
            .args(["netns", "exec", h.hosts[0].name(), "tc"])
            .args(tc),
    );
    qemu_io_ok(
        &h.a.uri("vol"),
        &["write -P 0x61 0 160M", "write -P 0x62 512M 32M"],
    );
    snapshot(&h.a, 2);
    let mut first = h
        .send(2, None, &["--resume"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(
        || kept_records(&h.b, 2) > 0,
        "durable progress of the receive",
    );
    unsafe { libc::kill(first.id() as i32, libc::SIGKILL) };
    let _ = first.wait();
    // The receiver notices the cut and keeps what it has.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !h.b.log().contains("refused") {
        assert!(
            Instant::now() < deadline,
            "the receiver did not see the cut"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let kept_records = kept_records(&h.b, 2);
    let summary = succeeded(
        h.send(2, None, &["--resume"]).output().unwrap(),
        "resumed send",
    );
    let started = summary["started_at_record"].as_u64().unwrap();
    assert!(
        started > 0 && started == kept_records,
        "{summary}, kept {kept_records}"
    );
    assert!(started < summary["sent"]["records"].as_u64().unwrap());
    same_snapshot(&h.a, &h.b, 2);
    thin_check(&h.b, &h.b_pool);
    // Refused while the sender still has most of a long stream to send (8 s of it on this
    // link): the reason reaches it, and it does not have to send the rest first.
    let t = Instant::now();
    let again = h.send(2, None, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && err.contains("thin device 2 exists"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}
