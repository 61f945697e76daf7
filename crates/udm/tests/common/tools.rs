//! The client tools the tests drive (qemu-io, qemu-img, nbdinfo, mkfs), peer servers, and
//! scratch files.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use udm_testkit::{printed, run_ok};

pub fn wait_for(mut ready: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs a client tool that must succeed; returns its standard output.
pub fn tool(program: &str, args: &[&str]) -> String {
    run_ok(Command::new(program).args(args))
}

/// An ext4 image of `size` bytes at `image` holding the files of `tree` (made without mounting).
pub fn ext4_image_of(tree: &Path, image: &Path, size: u64) {
    std::fs::File::create(image).unwrap().set_len(size).unwrap();
    tool(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-d",
            tree.to_str().unwrap(),
            image.to_str().unwrap(),
        ],
    );
}

/// `qemu-img compare` of two raw images (files or NBD URIs); fails the test if they differ.
pub fn same_content(a: &str, b: &str) {
    tool("qemu-img", &["compare", "-f", "raw", "-F", "raw", a, b]);
}

/// A peer server (nbdkit, qemu-nbd) run as a child and killed on drop.
pub struct Peer(pub Child);

impl Peer {
    /// Starts `program args…` and waits until `socket` accepts connections.
    pub fn start(program: &str, args: &[&str], socket: &Path) -> Peer {
        let _ = std::fs::remove_file(socket);
        let child = Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {program} (install it; .ci/run does): {e}"));
        let peer = Peer(child);
        wait_for(|| UnixStream::connect(socket).is_ok(), program);
        peer
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// qemu-io `commands` in one connection to `target` (an NBD URI or a file), with `options`
/// before them (e.g. `-t writeback`: qemu-io's default cache mode is writethrough, which
/// makes every write FUA): (succeeded, output). qemu-io reports a failed command (an I/O
/// error, a pattern that does not verify) on its output and still exits 0, so the output
/// decides too.
pub fn qemu_io_with(target: &str, options: &[&str], commands: &[&str]) -> (bool, String) {
    let mut args = vec!["-f", "raw"];
    args.extend_from_slice(options);
    for command in commands {
        args.extend(["-c", command]);
    }
    args.push(target);
    let out = Command::new("qemu-io")
        .args(&args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run qemu-io (install it; .ci/run does): {e}"));
    let text = printed(&out);
    let failed = text.contains("error") || text.contains("failed");
    (out.status.success() && !failed, text)
}

/// qemu-io `command` on `uri`: (succeeded, output).
pub fn qemu_io(uri: &str, command: &str) -> (bool, String) {
    qemu_io_with(uri, &[], &[command])
}

/// qemu-io `commands` in one connection that must all succeed; returns the output.
pub fn qemu_io_ok(target: &str, commands: &[&str]) -> String {
    qemu_io_ok_with(target, &[], commands)
}

/// [`qemu_io_ok`] with qemu-io `options`.
pub fn qemu_io_ok_with(target: &str, options: &[&str], commands: &[&str]) -> String {
    let (ok, out) = qemu_io_with(target, options, commands);
    assert!(ok, "qemu-io {commands:?} on {target} failed:\n{out}");
    out
}

/// qemu-io `command` that must fail with EIO; returns the output.
pub fn qemu_io_eio(target: &str, command: &str) -> String {
    let (ok, out) = qemu_io(target, command);
    assert!(
        !ok && out.contains("Input/output error"),
        "qemu-io {command:?} on {target} did not fail with EIO:\n{out}"
    );
    out
}

/// `nbdinfo --map` of `uri`: one row per extent (offset, length, type number, description).
pub fn nbd_map(uri: &str) -> Vec<Vec<String>> {
    tool("nbdinfo", &["--map", uri])
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// One row of [`nbd_map`], to look for.
pub fn extent(offset: u64, len: u64, kind: &str, description: &str) -> Vec<String> {
    vec![
        offset.to_string(),
        len.to_string(),
        kind.to_string(),
        description.to_string(),
    ]
}

/// fio over NBD on `uri`, every write verified (crc32c, the first mismatch fatal, no state
/// file left behind), with the job's own options in `job` (name, pattern, sizes, seed…).
pub fn fio_verified_command(uri: &str, job: &[&str]) -> Command {
    let mut fio = Command::new("fio");
    fio.args(["--ioengine=nbd", &format!("--uri={uri}")])
        .args([
            "--verify=crc32c",
            "--verify_state_save=0",
            "--verify_fatal=1",
        ])
        .args(job);
    fio
}

/// [`fio_verified_command`] run to its end; fio's output.
pub fn fio_verified(uri: &str, job: &[&str]) -> String {
    run_ok(&mut fio_verified_command(uri, job))
}

/// `qemu-img convert` of a raw image (file or URI) onto an existing raw one, in place (`-n`).
pub fn qemu_img_copy(from: &str, onto: &str) {
    tool(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", from, onto],
    );
}

/// `qemu-img convert` of a raw image (file or URI) into a new image `into` of `format`.
pub fn qemu_img_convert(from: &str, format: &str, into: &Path) {
    tool(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            format,
            from,
            into.to_str().unwrap(),
        ],
    );
}

/// The points `udm replay-log --check` checked, from its report ("… N entries; M checked …").
pub fn replay_points(report: &str) -> u64 {
    let after = report.rsplit("entries; ").next().unwrap();
    let points = after.split_whitespace().next().unwrap();
    points
        .parse()
        .unwrap_or_else(|_| panic!("no checked points in {report:?}"))
}

/// Runs `nbdsh -c SCRIPT`; returns (success, stdout + stderr). Debian's python3-libnbd is
/// built for the system python, so /usr/bin comes first on PATH.
pub fn nbdsh(script: &str) -> (bool, String) {
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let out = std::process::Command::new("nbdsh")
        .args(["-c", script])
        .env("PATH", path)
        .output()
        .expect("nbdsh (python3-libnbd; scripts/install-deps.sh installs it)");
    (out.status.success(), udm_testkit::printed(&out))
}

/// Open file descriptors of a process.
pub fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}
