//! Who can reach a device over TCP: TLS (STARTTLS with x509 certificates, optionally client
//! certificates) and per-listener export allow lists and read-only listeners, checked with
//! the real clients (qemu-img, nbdinfo, nbdcopy) and a raw socket where a polite client would
//! not even try.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// A CA, a server certificate for localhost/127.0.0.1 and a client certificate, in the
/// layouts qemu and libnbd read: `server/` (ca-cert, server-cert, server-key), `client/`
/// (ca-cert, client-cert, client-key) and `anonymous/` (ca-cert only).
struct Pki {
    server: PathBuf,
    client: PathBuf,
    anonymous: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    udm_testkit::run_ok(Command::new("openssl").args(args).current_dir(dir));
}

/// `openssl <command…>` making a new unencrypted P-256 key into `key`, then `rest`.
fn new_key(work: &Path, command: &[&str], key: &str, rest: &[&str]) {
    let mut args = command.to_vec();
    args.extend([
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        key,
    ]);
    args.extend_from_slice(rest);
    openssl(work, &args);
}

/// A P-256 key and a certificate for `subject`, signed by the CA in `work`.
fn signed(work: &Path, name: &str, subject: &str, extensions: &str) {
    std::fs::write(work.join(format!("{name}.ext")), extensions).unwrap();
    let (key, csr) = (format!("{name}-key.pem"), format!("{name}.csr"));
    new_key(work, &["req"], &key, &["-out", &csr, "-subj", subject]);
    openssl(
        work,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &format!("{name}-cert.pem"),
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

fn make_pki(dir: &TempDir) -> Pki {
    let work = dir.path("pki");
    std::fs::create_dir_all(&work).unwrap();
    let ca = [
        "-out",
        "ca-cert.pem",
        "-days",
        "2",
        "-subj",
        "/CN=udm test CA",
    ];
    new_key(&work, &["req", "-x509"], "ca-key.pem", &ca);
    signed(
        &work,
        "server",
        "/CN=localhost",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n\
         extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n",
    );
    // qemu insists on keyEncipherment in client certificates too.
    signed(
        &work,
        "client",
        "/CN=udm test client",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n\
         extendedKeyUsage=clientAuth\n",
    );
    let pki = Pki {
        server: dir.path("server-pki"),
        client: dir.path("client-pki"),
        anonymous: dir.path("anonymous-pki"),
    };
    for (into, files) in [
        (
            &pki.server,
            &["ca-cert.pem", "server-cert.pem", "server-key.pem"][..],
        ),
        (
            &pki.client,
            &["ca-cert.pem", "client-cert.pem", "client-key.pem"][..],
        ),
        (&pki.anonymous, &["ca-cert.pem"][..]),
    ] {
        std::fs::create_dir_all(into).unwrap();
        for f in files {
            std::fs::copy(work.join(f), into.join(f)).unwrap();
        }
    }
    pki
}

/// A daemon with `listener` (a `tcp:0…` option) and the extra flags, a 32 MiB device `vol`
/// on a file; returns the daemon, the TCP port and the backing file.
fn daemon_with(tag: &str, listener: &str, flags: &[&str]) -> (Daemon, u16, PathBuf) {
    let mut args = vec!["--nbd", listener];
    args.extend_from_slice(flags);
    let daemon = Daemon::start_with(tag, &args);
    let backing = daemon.create_linear("vol", "vol.img", 32 << 20);
    let port = daemon.tcp_ports()[0];
    (daemon, port, backing)
}

/// A fresh PKI (in its own scratch directory) and a daemon serving it: a `tcp:0` listener
/// with `--tls MODE --tls-certificates` the server's and the extra `flags`; returns the
/// scratch directory, the PKI, the daemon, its port and the device's backing file.
fn tls_daemon(tag: &str, mode: &str, flags: &[&str]) -> (TempDir, Pki, Daemon, u16, PathBuf) {
    let dir = TempDir::new("tls-pki");
    let pki = make_pki(&dir);
    let certs = pki.server.to_str().unwrap();
    let mut all = vec!["--tls", mode, "--tls-certificates", certs];
    all.extend_from_slice(flags);
    let (daemon, port, backing) = daemon_with(tag, "tcp:0", &all);
    (dir, pki, daemon, port, backing)
}

/// Runs a client that must fail; returns what it printed.
fn tool_fails(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap();
    let printed = udm_testkit::printed(&out);
    assert!(
        !out.status.success(),
        "{program} {args:?} unexpectedly succeeded:\n{printed}"
    );
    printed
}

fn nbds(port: u16, export: &str, certificates: &Path) -> String {
    format!(
        "nbds://localhost:{port}/{export}?tls-certificates={}",
        certificates.display()
    )
}

/// `qemu-img convert`s the export over TLS (x509 credentials from `certificates`) to `into`.
fn qemu_read_tls(port: u16, certificates: &Path, into: &Path) {
    let object = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        certificates.display()
    );
    let image = format!("driver=nbd,host=127.0.0.1,port={port},export=vol,tls-creds=tls0");
    tool(
        "qemu-img",
        &[
            "convert",
            "--object",
            &object,
            "--image-opts",
            &image,
            "-O",
            "raw",
            into.to_str().unwrap(),
        ],
    );
}

#[test]
fn tls_require_refuses_plaintext_and_serves_tls_clients() {
    let (dir, pki, daemon, port, backing) = tls_daemon("tls-require", "require", &[]);

    // Plaintext clients get nothing: not the export, not even the list of names.
    let plain = format!("nbd://127.0.0.1:{port}/vol");
    let printed = tool_fails("qemu-img", &["info", &plain]);
    assert!(printed.contains("TLS"), "qemu-img said: {printed}");
    tool_fails("nbdinfo", &[&plain]);
    tool_fails("nbdinfo", &["--list", &format!("nbd://127.0.0.1:{port}")]);

    // A TLS client writes (nbdcopy) and another reads back (qemu-img): same bytes, and they
    // reached the backing file.
    let source = dir.path("source.raw");
    pattern_file(&source, 32 << 20, 7);
    tool(
        "nbdcopy",
        &[source.to_str().unwrap(), &nbds(port, "vol", &pki.anonymous)],
    );
    let back = dir.path("back.raw");
    qemu_read_tls(port, &pki.anonymous, &back);
    same_content(source.to_str().unwrap(), back.to_str().unwrap());
    same_content(source.to_str().unwrap(), backing.to_str().unwrap());
    let listed = tool("nbdinfo", &["--list", &nbds(port, "", &pki.anonymous)]);
    assert!(listed.contains("export=\"vol\""), "{listed}");
    drop(daemon);
}

#[test]
fn tls_on_serves_plaintext_and_tls_clients() {
    let (dir, pki, daemon, port, _) = tls_daemon("tls-on", "on", &[]);
    let threads = || daemon.threads().0;
    let idle = threads();
    let source = dir.path("source.raw");
    pattern_file(&source, 8 << 20, 11);
    qemu_img_copy(
        source.to_str().unwrap(),
        &format!("nbd://127.0.0.1:{port}/vol"),
    );
    let back = dir.path("back.raw");
    let started = std::time::Instant::now();
    tool(
        "nbdcopy",
        &[&nbds(port, "vol", &pki.anonymous), back.to_str().unwrap()],
    );
    // A client that says goodbye waits for the server's close; a relay that missed the end
    // of the connection would hold it for the 30 s drain timeout.
    let took = started.elapsed();
    assert!(took.as_secs() < 15, "a TLS copy of 32 MiB took {took:?}");
    // (The device is larger: compare wants the rest zero, as it is.)
    same_content(source.to_str().unwrap(), back.to_str().unwrap());
    let plain = tool("nbdinfo", &[&format!("nbd://127.0.0.1:{port}/vol")]);
    assert!(plain.contains("without TLS"), "{plain}");
    let tls = tool("nbdinfo", &[&nbds(port, "vol", &pki.anonymous)]);
    assert!(tls.contains("with TLS"), "{tls}");
    // Every connection's threads, the TLS relays among them, end with their clients.
    wait_for(|| threads() == idle, "the connections' threads to end");
}

#[test]
fn tls_verify_peer_serves_only_clients_with_a_certificate_from_the_ca() {
    let (dir, pki, daemon, port, _) = tls_daemon("tls-peer", "require", &["--tls-verify-peer"]);
    tool_fails("nbdinfo", &["--size", &nbds(port, "vol", &pki.anonymous)]);
    assert!(
        daemon.log().contains("peer sent no certificates"),
        "{}",
        daemon.log()
    );
    let size = tool("nbdinfo", &["--size", &nbds(port, "vol", &pki.client)]);
    assert_eq!(size.trim(), (32u64 << 20).to_string());
    let back = dir.path("back.raw");
    qemu_read_tls(port, &pki.client, &back);
}

#[test]
fn tls_setup_errors_name_what_is_wrong() {
    let dir = TempDir::new("tls-flags");
    let run = |args: &[&str]| {
        let out = Command::new(UDM)
            .args(["daemon", "--state-dir"])
            .arg(dir.path("state"))
            .arg("--control")
            .arg(dir.path("control.sock"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8(out.stderr).unwrap()
    };
    let missing = dir.path("nowhere");
    let err = run(&[
        "--tls",
        "on",
        "--tls-certificates",
        missing.to_str().unwrap(),
    ]);
    assert!(err.contains("nowhere/server-cert.pem"), "{err}");
    let err = run(&["--tls", "require"]);
    assert!(err.contains("--tls-certificates"), "{err}");
    let err = run(&["--tls-verify-peer"]);
    assert!(err.contains("--tls on"), "{err}");
}

#[test]
fn listener_allow_list_hides_other_devices() {
    let (daemon, port, _) = daemon_with("allow", "tcp:0,export=vol", &[]);
    daemon.create("other", "0 2048 zero");
    let listed = tool("nbdinfo", &["--list", &format!("nbd://127.0.0.1:{port}")]);
    assert!(listed.contains("export=\"vol\""), "{listed}");
    assert!(
        !listed.contains("other"),
        "listed a device outside the allow list: {listed}"
    );
    let printed = tool_fails("nbdinfo", &[&format!("nbd://127.0.0.1:{port}/other")]);
    assert!(printed.contains("other"), "{printed}");
    // The Unix socket, guarded by its permissions, still serves every device.
    let all = tool(
        "nbdinfo",
        &[
            "--list",
            &format!("nbd+unix://?socket={}", daemon.nbd_socket().display()),
        ],
    );
    assert!(all.contains("export=\"other\""), "{all}");
}

#[test]
fn read_only_listener_refuses_writes_with_eperm() {
    let (daemon, port, backing) = daemon_with("ro", "tcp:0,read-only", &[]);
    let info = tool("nbdinfo", &[&format!("nbd://127.0.0.1:{port}/vol")]);
    assert!(info.contains("is_read_only: true"), "{info}");
    // A client that writes anyway is refused by the server, not just told.
    let mut client = RawClient::connect_tcp(port, "vol");
    client.send(0, NBD_CMD_WRITE, 1, 0, 512, &[0xab; 512]);
    assert_eq!(client.reply().unwrap(), (1, 1), "EPERM for the write");
    assert!(std::fs::read(&backing).unwrap()[..512]
        .iter()
        .all(|&b| b == 0));
    // The same device stays writable through the unrestricted Unix socket.
    let mut unix = RawClient::connect(&daemon.nbd_socket(), "vol");
    unix.send(0, NBD_CMD_WRITE, 2, 0, 512, &[0xab; 512]);
    assert_eq!(unix.reply().unwrap(), (0, 2));
}
