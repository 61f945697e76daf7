//! A path's server that dies with writes it acknowledged but never flushed (held in a cache
//! that died with it) makes the multipath's next flush fail with EIO, once: whether the path
//! is still failed when the flush comes or back by then. Another path's flush cannot cover
//! them: they never reached the storage it would flush.

use std::io::Read;
use std::path::Path;

use super::*;

/// nbdkit serving `image` on `socket`; with `cache`, through its cache filter in writeback
/// mode, which keeps writes in nbdkit's memory until a flush: they die with it.
fn nbdkit(socket: &Path, image: &Path, cache: bool) -> Peer {
    let mut args = vec!["-f", "-U", socket.to_str().unwrap()];
    if cache {
        args.push("--filter=cache");
    }
    args.extend(["file", image.to_str().unwrap()]);
    if cache {
        args.push("cache=writeback");
    }
    Peer::start("nbdkit", &args, socket)
}

/// A multipath over two nbdkits on one image, the first (`cached`) holding writes in memory
/// until a flush; the client of the multipath and its two paths.
struct Rig {
    daemon: Daemon,
    image: std::path::PathBuf,
    client: RawClient,
    cached: String,
    plain: String,
    next_cookie: u64,
}

impl Rig {
    fn new(tag: &str) -> (Rig, Peer, Peer) {
        let daemon = Daemon::start(tag);
        let image = daemon.sparse("disk.img", 16 * MIB);
        let path = |socket: &Path| format!("nbd+unix:///?socket={}", socket.display());
        let sockets = [
            daemon.dir.path("cached.sock"),
            daemon.dir.path("plain.sock"),
        ];
        let cached_server = nbdkit(&sockets[0], &image, true);
        let plain_server = nbdkit(&sockets[1], &image, false);
        let (cached, plain) = (path(&sockets[0]), path(&sockets[1]));
        // The cached path reads its unflushed writes, the plain one the image: one device
        // read two ways, which the identity check would take for two devices.
        daemon.create(
            "mp",
            &format!(
                "0 {} multipath 3 checker_interval 1 no_path_identity_check 0 1 1 round-robin 0 \
                 2 1 {cached} 1 {plain} 1",
                16 * MIB / 512
            ),
        );
        let client = RawClient::connect(&daemon.nbd_socket(), "mp");
        let rig = Rig {
            daemon,
            image,
            client,
            cached,
            plain,
            next_cookie: 1,
        };
        (rig, cached_server, plain_server)
    }

    fn restart_cached(&self) -> Peer {
        nbdkit(&self.daemon.dir.path("cached.sock"), &self.image, true)
    }

    /// The state and fail count of the cached path: "A 0".
    fn cached_state(&self) -> String {
        path_state(&self.daemon.udm(&["status", "mp"]), &self.cached)
    }

    fn wait_cached(&self, state: &str) {
        wait_for(
            || self.cached_state() == state,
            &format!("the cached path to be {state}"),
        );
    }

    /// NBD requests on the multipath: the error each got.
    fn request(&mut self, command: u16, offset: u64, data: &[u8]) -> u32 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let len = data.len() as u32;
        self.client.send(0, command, cookie, offset, len, data);
        let (error, replied) = self.client.reply().unwrap();
        assert_eq!(replied, cookie);
        error
    }

    /// Writes `data` at `offset` down the cached path: the other one is failed meanwhile.
    fn write_to_cached(&mut self, offset: u64, data: &[u8]) {
        let plain = self.plain.clone();
        self.daemon
            .udm(&["message", "mp", "0", "fail_path", &plain]);
        assert_eq!(self.request(NBD_CMD_WRITE, offset, data), 0);
        self.daemon
            .udm(&["message", "mp", "0", "reinstate_path", &plain]);
    }

    fn flush(&mut self) -> u32 {
        self.request(NBD_CMD_FLUSH, 0, &[])
    }

    /// 4 KiB of the image itself, under both servers.
    fn on_disk(&self, offset: u64) -> Vec<u8> {
        let mut file = std::fs::File::open(&self.image).unwrap();
        let mut buf = vec![0u8; 4096];
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(offset)).unwrap();
        file.read_exact(&mut buf).unwrap();
        buf
    }
}

const EIO: u32 = libc::EIO as u32;

/// Found by hand: writes down a path whose server (nbdkit's writeback cache) was killed
/// before a flush were reported durable by the multipath's next flush, which went down the
/// other path only; and once the path was back, its client's "writes lost" error failed the
/// path and the flush was retried down the other path, which succeeded.
#[test]
fn a_flush_fails_when_a_path_server_lost_writes_it_acknowledged() {
    let (mut rig, cached_server, _plain_server) = Rig::new("mp-lost-writes");
    let block = |seed: u8| vec![seed; 4096];

    // The flush comes while the path is still failed.
    rig.write_to_cached(0, &block(1));
    drop(cached_server);
    rig.wait_cached("F 1");
    assert_eq!(rig.flush(), EIO, "{}", rig.daemon.log());
    assert!(
        rig.on_disk(0) != block(1),
        "the write was not lost after all"
    );
    // Said once, as the kernel says a lost writeback once.
    assert_eq!(rig.flush(), 0, "{}", rig.daemon.log());

    // The flush comes once the path is back, its server restarted.
    let cached_server = rig.restart_cached();
    rig.wait_cached("A 1");
    rig.write_to_cached(MIB, &block(2));
    drop(cached_server);
    rig.wait_cached("F 2");
    let cached_server = rig.restart_cached();
    rig.wait_cached("A 2");
    assert_eq!(rig.flush(), EIO, "{}", rig.daemon.log());
    assert!(
        rig.on_disk(MIB) != block(2),
        "the write was not lost after all"
    );
    assert_eq!(rig.flush(), 0, "{}", rig.daemon.log());
    // The path was not failed for it: its server is fine now.
    assert_eq!(rig.cached_state(), "A 2");

    // Writes the server flushed before it died are durable: no error.
    rig.write_to_cached(2 * MIB, &block(3));
    assert_eq!(rig.flush(), 0);
    drop(cached_server);
    rig.wait_cached("F 3");
    assert_eq!(rig.flush(), 0, "{}", rig.daemon.log());
    assert!(rig.on_disk(2 * MIB) == block(3));
}
