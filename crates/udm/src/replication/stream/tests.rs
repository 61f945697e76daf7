//! Streams written and read back, and every way a stream can be damaged refused.

use super::*;

fn header(records: u64) -> Header {
    Header {
        block_bytes: 65536,
        to_id: 5,
        to_time: 9,
        to_stamp: Stamp {
            newest_mapping: Some(8),
            mapped_blocks: 17,
        },
        from_id: 3,
        from_time: 4,
        from_stamp: Stamp {
            newest_mapping: None,
            mapped_blocks: 0,
        },
        volume_bytes: 1 << 20,
        records,
        changed_bytes: 8192,
        source: "host/pool".into(),
    }
}

/// A stream of data, zero and unmapped records, from record `first` on; its bytes and
/// the byte offsets where its records start.
fn stream(first: u64) -> (Vec<u8>, Vec<usize>) {
    let places = [
        (Kind::Data, 0u64, 4096u32),
        (Kind::Zero, 8192, 4096),
        (Kind::Unmapped, 65536, 131072),
        (Kind::Data, 1040384, 8192),
    ];
    let mut out = header(places.len() as u64).encode();
    let mut layout = Layout::default();
    for (seq, &(_, offset, len)) in places.iter().enumerate().take(first as usize) {
        layout.add(Place {
            seq: seq as u64,
            offset,
            len,
        });
    }
    let mut starts = Vec::new();
    let mut w = Writer::new(Vec::new(), layout);
    for (seq, &(kind, offset, len)) in places.iter().enumerate().skip(first as usize) {
        starts.push(out.len() + w.out.len());
        let payload = vec![seq as u8 + 1; if kind == Kind::Data { len as usize } else { 0 }];
        w.record(
            kind,
            Place {
                seq: seq as u64,
                offset,
                len,
            },
            &payload,
        )
        .unwrap();
    }
    starts.push(out.len() + w.out.len());
    out.extend(w.finish(places.len() as u64).unwrap());
    (out, starts)
}

/// Reads a whole stream as a receiver holding records before `have` (with their layout);
/// the records applied.
fn read(bytes: &[u8], have: u64, layout: Layout) -> Result<Vec<(Kind, u64, u32, u8)>> {
    let mut input = bytes;
    let h = Header::read(&mut input)?;
    let mut r = Reader::new(input, h, have, layout);
    let mut got = Vec::new();
    loop {
        match r.next_event()? {
            Event::Record {
                kind,
                place,
                payload,
            } => got.push((
                kind,
                place.offset,
                place.len,
                payload.first().copied().unwrap_or(0),
            )),
            Event::End => return Ok(got),
        }
    }
}

#[test]
fn a_stream_reads_back_as_written() {
    let (bytes, _) = stream(0);
    let got = read(&bytes, 0, Layout::default()).unwrap();
    assert_eq!(
        got,
        [
            (Kind::Data, 0, 4096, 1),
            (Kind::Zero, 8192, 4096, 0),
            (Kind::Unmapped, 65536, 131072, 0),
            (Kind::Data, 1040384, 8192, 4)
        ]
    );
    let mut input = &bytes[..];
    assert_eq!(Header::read(&mut input).unwrap(), header(4));
}

#[test]
fn every_flipped_byte_and_every_cut_is_refused() {
    let (bytes, _) = stream(0);
    for at in 0..bytes.len() {
        let mut bad = bytes.clone();
        bad[at] ^= 0x10;
        assert!(
            read(&bad, 0, Layout::default()).is_err(),
            "byte {at} flipped"
        );
    }
    for len in 0..bytes.len() {
        let err = read(&bytes[..len], 0, Layout::default()).unwrap_err();
        assert!(matches!(err, StreamError::Cut(_)), "cut at {len}: {err}");
    }
}

#[test]
fn reordered_dropped_and_appended_records_are_refused() {
    let (bytes, s) = stream(0);
    let swapped = [
        &bytes[..s[1]],
        &bytes[s[2]..s[3]],
        &bytes[s[1]..s[2]],
        &bytes[s[3]..],
    ]
    .concat();
    let err = read(&swapped, 0, Layout::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("record 2 where record 1 belongs"), "{err}");
    let dropped = [&bytes[..s[2]], &bytes[s[3]..]].concat();
    let err = read(&dropped, 0, Layout::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("record 3 where record 2 belongs"), "{err}");
    // The last record dropped: the trailer comes early.
    let short = [&bytes[..s[3]], &bytes[s[4]..]].concat();
    let err = read(&short, 0, Layout::default()).unwrap_err().to_string();
    assert!(err.contains("promises 4 records"), "{err}");
}

/// A stream goes on to its trailer and ends there: whatever follows (another stream after it,
/// as `cat inc12 inc13` makes, or garbage) is not a stream this reader checked.
#[test]
fn bytes_after_the_trailer_are_refused() {
    let (bytes, _) = stream(0);
    let garbage: Vec<u8> = (0..5 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for (what, tail) in [
        ("a stream", &bytes[..]),
        ("garbage", &garbage),
        ("a byte", &[0][..]),
    ] {
        let err = read(&[&bytes[..], tail].concat(), 0, Layout::default())
            .expect_err(what)
            .to_string();
        assert!(err.contains("after its trailer"), "{what}: {err}");
    }
}

#[test]
fn a_stream_of_version_1_is_refused_saying_to_send_it_again() {
    let mut b = header(1).encode();
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    let err = Header::read(&mut &b[..]).unwrap_err();
    assert!(matches!(err, StreamError::Version(1)), "{err}");
    assert!(err.to_string().contains("send it again"), "{err}");
}

#[test]
fn a_resumed_stream_continues_where_the_receiver_stopped() {
    let (full, _) = stream(0);
    // The receiver committed records 0 and 1 of the full stream.
    let mut layout = Layout::default();
    layout.add(Place {
        seq: 0,
        offset: 0,
        len: 4096,
    });
    layout.add(Place {
        seq: 1,
        offset: 8192,
        len: 4096,
    });
    let (resumed, _) = stream(2);
    let got = read(&resumed, 2, layout).unwrap();
    assert_eq!(got.len(), 2);
    // The whole stream again: records it has are read (and skipped by the receiver).
    assert_eq!(read(&full, 2, layout).unwrap().len(), 4);
    // A stream that starts past what the receiver has, or a wrong layout, is refused.
    let (later, _) = stream(3);
    let err = read(&later, 2, layout).unwrap_err().to_string();
    assert!(err.contains("starts at record 3"), "{err}");
    let err = read(&resumed, 2, Layout::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("checksum of the records"), "{err}");
}

#[test]
fn hostile_headers_are_refused_before_anything_is_allocated() {
    let mut b = header(1).encode();
    b[88] = 0xff;
    b[89] = 0xff;
    assert!(Header::read(&mut &b[..]).is_err());
    let err = Header::read(
        &mut &b"not a stream at all, really no no no no no no no no no no no no no"[..],
    )
    .unwrap_err();
    assert!(matches!(err, StreamError::NotAStream(_)), "{err}");
}
