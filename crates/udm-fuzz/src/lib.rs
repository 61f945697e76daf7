//! The properties the fuzzers check, one function per target. Each takes arbitrary bytes and
//! panics only when udm misbehaves: every input must get an error or a result, never a crash,
//! a hang or an inconsistency.

pub mod thin;

use std::io::{Read, Write};
use std::sync::Arc;

use udm_block::{BlockDevice, MemoryDevice, WriteFlags};
use udm_targets::Table;
use udm_testkit::Devices;

/// A client byte stream: reads the fuzz input, swallows the server's replies.
struct Scripted<'a> {
    input: &'a [u8],
}

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The NBD handshake, from the client's first bytes to the chosen export.
pub fn nbd_handshake(data: &[u8]) {
    let mut stream = Scripted { input: data };
    let catalog = Devices::memory(&[("vol", 1 << 20)]);
    if let Ok(negotiated) = udm_nbd::handshake::negotiate(&mut stream, &catalog) {
        assert_eq!(negotiated.export.device.size(), 1 << 20);
    }
}

/// Request headers and option payloads: parse, and re-encode what parsed.
pub fn nbd_request(data: &[u8]) {
    use udm_nbd::protocol::*;
    if let Ok(header) =
        <&[u8; REQUEST_HEADER_LEN]>::try_from(data.get(..REQUEST_HEADER_LEN).unwrap_or(&[]))
    {
        if let Ok(request) = parse_request(header) {
            assert_eq!(&encode_request(&request), header);
        }
    }
    let _ = parse_info_request(data);
    let _ = parse_meta_context_request(data);
}

/// Table text: builds or says why not; what builds prints back to an equal table.
pub fn table(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let devices = Devices::memory(&[("a", 4 << 20), ("b", 4 << 20), ("meta", 4 << 20)]);
    if let Ok(table) = Table::build("test", text, &devices, Arc::new(|| {})) {
        let printed = table.lines().join("\n");
        let again = Table::build("test", &printed, &devices, Arc::new(|| {}))
            .unwrap_or_else(|e| panic!("printed table {printed:?} does not parse back: {e}"));
        assert_eq!(again.lines().join("\n"), printed);
        let _ = table.status_lines();
    }
}

/// Control protocol requests as the daemon decodes them.
pub fn control(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(envelope) = serde_json::from_str::<udm::control::Envelope>(text) {
        let encoded = serde_json::to_string(&envelope).expect("a decoded request encodes");
        serde_json::from_str::<udm::control::Envelope>(&encoded).expect("and decodes again");
    }
    let _ = serde_json::from_str::<udm::control::Response>(text);
}

/// A metadata device holding arbitrary bytes: opening the clone metadata fails cleanly or
/// gives a bitmap whose count is consistent.
pub fn clone_metadata(data: &[u8]) {
    let dev = MemoryDevice::new(64 << 10);
    let len = data.len().min(64 << 10);
    dev.write(0, &data[..len], WriteFlags::default())
        .expect("memory write");
    let geometry = udm_metadata::CloneGeometry {
        region_sectors: 8,
        target_sectors: 8 * 1000,
    };
    if let Ok(meta) = udm_metadata::CloneMetadata::open(Arc::new(dev), geometry) {
        let counted = (0..1000).filter(|&r| meta.is_hydrated(r)).count() as u64;
        assert_eq!(counted, meta.hydrated_count());
    }
}

/// A COW device holding arbitrary bytes: the snapshot store refuses it cleanly, or loads
/// records that each name a data chunk on the device, once; a commit then lands and reads
/// back.
pub fn snapshot_cow(data: &[u8]) {
    use udm_metadata::snapshot::{ExceptionStore, PersistentStore, Record};
    let dev = Arc::new(MemoryDevice::new(64 << 10));
    let len = data.len().min(64 << 10);
    dev.write(0, &data[..len], WriteFlags::default())
        .expect("memory write");
    let Ok(opened) = PersistentStore::open(dev.clone(), 8) else {
        return;
    };
    let geometry = opened.store.geometry();
    let mut news = std::collections::HashSet::new();
    for r in &opened.records {
        assert!(r.new < geometry.chunks && !geometry.is_metadata(r.new));
        assert!(news.insert(r.new));
    }
    let olds: std::collections::HashSet<u64> = opened.records.iter().map(|r| r.old).collect();
    let old = (0..)
        .find(|o| !olds.contains(o))
        .expect("a free origin chunk");
    if let Ok(new) = opened.store.allocate() {
        let record = Record { old, new };
        let ticket = opened.store.submit(&[record]).expect("submit");
        opened.store.wait(ticket).expect("commit");
        drop(opened);
        let again = PersistentStore::open(dev, 8).expect("reopen after a commit");
        assert_eq!(again.records.last(), Some(&record));
    }
}

/// A log device holding arbitrary bytes: the reader stops cleanly.
pub fn write_log(data: &[u8]) {
    let dev = MemoryDevice::new(64 << 10);
    let len = data.len().min(64 << 10);
    dev.write(0, &data[..len], WriteFlags::default())
        .expect("memory write");
    if let Ok(mut reader) = udm_metadata::log::LogReader::open(Arc::new(dev)) {
        for _ in 0..1000 {
            match reader.next_entry() {
                Ok(Some((entry, payload))) => {
                    assert!(payload.len() as u64 <= 64 << 10 && entry.mark.len() <= 256)
                }
                _ => break,
            }
        }
    }
}

/// What a fuzz target checks, given its input.
pub type Property = fn(&[u8]);

/// A replication stream as a receiver reads it (from another host: hostile): refused or read
/// record by record, never a panic; and what reads back whole writes out as the same bytes.
pub fn replication_stream(data: &[u8]) {
    use udm::replication::stream::{Event, Header, Layout, Reader, Writer};
    let mut input = data;
    let Ok(header) = Header::read(&mut input) else {
        return;
    };
    let mut reader = Reader::new(input, header.clone(), 0, Layout::default());
    let mut again = Writer::new(header.encode(), Layout::default());
    loop {
        match reader.next_event() {
            Ok(Event::Record {
                kind,
                place,
                payload,
            }) => again
                .record(kind, place, payload)
                .expect("writes to memory"),
            Ok(Event::End) => {
                let written = again.finish(header.records).expect("writes to memory");
                // Nothing may follow the trailer: the whole input is the stream.
                assert_eq!(written, data, "a stream that reads back differs");
                return;
            }
            Err(_) => return,
        }
    }
}

/// Every target by name, for the corpus replay.
pub const TARGETS: &[(&str, Property)] = &[
    ("nbd_handshake", nbd_handshake),
    ("nbd_request", nbd_request),
    ("table", table),
    ("control", control),
    ("clone_metadata", clone_metadata),
    ("write_log", write_log),
    ("snapshot_cow", snapshot_cow),
    ("thin_metadata", thin::thin_metadata),
    ("replication_stream", replication_stream),
];
