//! Thin volumes: fio and qemu-io on them, snapshots of snapshots against thin_ls and
//! thin_dump, and a pool made by thin_restore.

use super::*;

#[test]
fn fio_and_qemu_io_on_a_thin_volume_verify_and_the_pool_checks_clean() {
    let daemon = Daemon::start("thin-fio");
    let pool = make_pool(&daemon, "pool", 1024, "");
    make_volume(&daemon, &pool, "vol", 1, 64 * MIB);
    let fio = |extra: &[&str]| {
        let job = [
            "--name=thin",
            "--rw=randwrite",
            "--bsrange=4k-192k",
            "--iodepth=16",
            "--offset=4M",
            "--size=24M",
            "--randseed=11",
        ];
        fio_verified(&daemon.uri("vol"), &[&job[..], extra].concat())
    };
    fio(&[]);
    fio(&["--verify_only"]);
    fill(&daemon, "vol", 0x5a, 40 * MIB + 4 * KIB, 8 * KIB);
    let data = contents(&daemon, "vol");
    expect_bytes(&data, 0, 4 * MIB, 0, "never written");
    expect_bytes(&data, 40 * MIB, 4 * KIB, 0, "zeroed part of a new block");
    expect_bytes(&data, 40 * MIB + 4 * KIB, 8 * KIB, 0x5a, "qemu-io's write");
    expect_bytes(
        &data,
        40 * MIB + 12 * KIB,
        BLOCK - 12 * KIB,
        0,
        "zeroed part of a new block",
    );
    // The thin status says what the pool says, and thin_check agrees once it is still.
    let used = data_used(&daemon, &pool);
    let line = status(&daemon, "vol");
    let mapped: u64 = line.split(' ').nth(3).unwrap().parse().unwrap();
    assert_eq!(mapped, used * 128, "{line}");
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["remove", "pool"]);
    thin_check(&pool.meta);
}

/// Per thin device (id, mapped, exclusive, shared blocks): `udm thin ls` and `status --json`
/// say `expected`, thin_ls says the same of the metadata, and each of `volumes` (name, id)
/// serves block for block what thin_dump maps; returns the dump.
fn usage_agrees_with_thin_tools(
    daemon: &Daemon,
    pool: &Pool,
    volumes: &[(&str, u32)],
    expected: &[(u64, u64, u64, u64)],
) -> Dump {
    let ls = daemon.udm(&["thin", "ls", &pool.name]);
    let details = pool_details(daemon, pool);
    let ours: Vec<(u64, u64, u64, u64)> = details["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let n = |k: &str| d[k].as_u64().unwrap();
            (
                n("id"),
                n("mapped_blocks"),
                n("exclusive_blocks"),
                n("shared_blocks"),
            )
        })
        .collect();
    assert_eq!(ours, expected, "{details}");
    for (id, mapped, exclusive, shared) in &ours {
        let row = ls
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&id.to_string()))
            .unwrap_or_else(|| panic!("no row for {id}:\n{ls}"));
        let fields: Vec<&str> = row.split_whitespace().collect();
        let want = [mapped, exclusive, shared].map(|n| n.to_string());
        assert_eq!(&fields[1..4], &want, "{ls}");
    }
    let names: Vec<&str> = volumes.iter().map(|(name, _)| *name).collect();
    let (tools_ls, dump) = with_pool_still(daemon, pool, &names, || {
        thin_check(&pool.meta);
        let columns = "DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS,SHARED_BLOCKS";
        let meta = pool.meta.to_str().unwrap();
        let ls = tool("thin_ls", &["--no-headers", "-o", columns, meta]);
        (ls, thin_dump(&pool.meta))
    });
    let theirs: Vec<(u64, u64, u64, u64)> = tools_ls
        .lines()
        .map(|l| {
            let f: Vec<u64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (f[0], f[1], f[2], f[3])
        })
        .collect();
    assert_eq!(ours, theirs, "udm thin ls against thin_ls");
    // The same blocks mapped, holding the bytes the data file holds where thin_dump says.
    let data_file = std::fs::read(&pool.data).unwrap();
    for (volume, id) in volumes {
        let mappings = &dump.devices[id];
        assert_eq!(
            mapped_blocks_of(daemon, volume),
            mappings.keys().copied().collect::<Vec<_>>(),
            "{volume}: block status against thin_dump"
        );
        let served = contents(daemon, volume);
        for (vblock, data_block) in mappings {
            let v = (*vblock * BLOCK) as usize;
            let d = (*data_block * BLOCK) as usize;
            assert!(
                served[v..v + BLOCK as usize] == data_file[d..d + BLOCK as usize],
                "{volume}: block {vblock} is not data block {data_block}"
            );
        }
    }
    dump
}

/// The end of `snapshots_keep_old_data_chain_and_delete_frees_exactly`: the origin rolled
/// back to its snapshot, then every device deleted, each freeing only its own blocks.
fn deleting_frees_exactly_the_blocks_no_one_else_holds(daemon: &Daemon, pool: &Pool) {
    // Roll the origin back to the snapshot: the volume now maps device 2.
    daemon.udm(&["suspend", "vol"]);
    daemon.udm(&["remove", "snap"]);
    daemon.udm(&[
        "load",
        "vol",
        "--table",
        &format!("0 {} thin pool 2", 4 * MIB / 512),
    ]);
    daemon.udm(&["resume", "vol"]);
    daemon.udm(&["message", "pool", "0", "delete", "1"]);
    expect_bytes(
        &contents(daemon, "vol"),
        7 * BLOCK,
        BLOCK,
        0xc4,
        "rolled back",
    );
    // Device 1's own 4 blocks are free; the rest are still held by 2 and 3.
    assert_eq!(data_used(daemon, pool), 9);
    daemon.udm(&["remove", "snap2"]);
    daemon.udm(&["message", "pool", "0", "delete", "3"]);
    assert_eq!(data_used(daemon, pool), 8);
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["message", "pool", "0", "delete", "2"]);
    assert_eq!(data_used(daemon, pool), 0);
    daemon.udm(&["remove", "pool"]);
    thin_check(&pool.meta);
}

#[test]
fn snapshots_keep_old_data_chain_and_delete_frees_exactly() {
    let daemon = Daemon::start("thin-snap");
    let pool = make_pool(&daemon, "pool", 256, "");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 0xa1, 0, 8 * BLOCK);
    assert_eq!(data_used(&daemon, &pool), 8);
    // The origin is live: a snapshot is refused until it is suspended.
    let err = daemon.udm_err(&["message", "pool", "0", "create_snap", "2", "1"]);
    assert!(err.contains("suspend it first"), "{err}");
    snapshot(&daemon, &pool, "vol", 2, 1);
    open_volume(&daemon, &pool, "snap", 2, 4 * MIB);
    assert_eq!(data_used(&daemon, &pool), 8, "a snapshot copies no data");
    // Overwrite half of the origin: partial writes copy, whole-block ones do not.
    fill(&daemon, "vol", 0xb2, 0, 3 * BLOCK);
    fill(&daemon, "vol", 0xb3, 3 * BLOCK + 4 * KIB, 4 * KIB);
    assert_eq!(data_used(&daemon, &pool), 12);
    let snap = contents(&daemon, "snap");
    expect_bytes(&snap, 0, 8 * BLOCK, 0xa1, "the snapshot");
    expect_bytes(
        &snap,
        8 * BLOCK,
        4 * MIB - 8 * BLOCK,
        0,
        "the snapshot's tail",
    );
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 3 * BLOCK, 0xb2, "the origin's new data");
    expect_bytes(&vol, 3 * BLOCK, 4 * KIB, 0xa1, "the origin's copied block");
    expect_bytes(
        &vol,
        3 * BLOCK + 4 * KIB,
        4 * KIB,
        0xb3,
        "the origin's partial write",
    );
    // A snapshot of the snapshot; then the snapshot changes and its snapshot does not.
    snapshot(&daemon, &pool, "snap", 3, 2);
    open_volume(&daemon, &pool, "snap2", 3, 4 * MIB);
    fill(&daemon, "snap", 0xc4, 7 * BLOCK, BLOCK);
    assert_eq!(data_used(&daemon, &pool), 13);
    expect_bytes(
        &contents(&daemon, "snap2"),
        0,
        8 * BLOCK,
        0xa1,
        "the snapshot's snapshot",
    );
    expect_bytes(
        &contents(&daemon, "snap"),
        7 * BLOCK,
        BLOCK,
        0xc4,
        "the snapshot's write",
    );

    // thin ls and status --json give the same numbers, thin_ls agrees, and thin_dump's
    // mappings are what udm serves.
    // Device 1: 3 whole new blocks + 1 copied (exclusive), 4 shared with 2 and 3.
    // Device 2: 8 mapped, 7 shared (with 1 and 3), block 7 its own now.
    // Device 3: 8 mapped, every one shared (block 7 with device 1, the rest with 2).
    let volumes = [("vol", 1), ("snap", 2), ("snap2", 3)];
    let dump = usage_agrees_with_thin_tools(
        &daemon,
        &pool,
        &volumes,
        &[(1, 8, 4, 4), (2, 8, 1, 7), (3, 8, 0, 8)],
    );
    assert_eq!(dump.nr_data_blocks, 256);

    deleting_frees_exactly_the_blocks_no_one_else_holds(&daemon, &pool);
}

#[test]
fn a_pool_made_by_thin_restore_serves_the_data_its_xml_maps() {
    let daemon = Daemon::start("thin-restore");
    let meta = daemon.sparse("restored.meta", 8 * MIB);
    let data = daemon.dir.path("restored.data");
    // Data blocks 0..16, block n filled with byte 0x10 + n.
    let mut bytes = vec![0u8; (16 * BLOCK) as usize];
    for (n, block) in bytes.chunks_mut(BLOCK as usize).enumerate() {
        block.fill(0x10 + n as u8);
    }
    std::fs::write(&data, &bytes).unwrap();
    let xml = daemon.dir.path("pool.xml");
    std::fs::write(
        &xml,
        r#"<superblock uuid="" time="1" transaction="5" flags="0" version="2" data_block_size="128" nr_data_blocks="16">
  <device dev_id="1" mapped_blocks="3" transaction="0" creation_time="0" snap_time="1">
    <range_mapping origin_begin="0" data_begin="3" length="2" time="0"/>
    <single_mapping origin_block="10" data_block="7" time="0"/>
  </device>
  <device dev_id="4" mapped_blocks="1" transaction="0" creation_time="1" snap_time="1">
    <single_mapping origin_block="0" data_block="3" time="0"/>
  </device>
</superblock>
"#,
    )
    .unwrap();
    tool(
        "thin_restore",
        &["-i", xml.to_str().unwrap(), "-o", meta.to_str().unwrap()],
    );
    daemon.create("pool", &thin_pool_table(&meta, &data, 16 * BLOCK, "0"));
    daemon.create("vol", &format!("0 {} thin pool 1", 16 * BLOCK / 512));
    daemon.create("snap", &format!("0 {} thin pool 4", 16 * BLOCK / 512));
    let line = status(&daemon, "pool");
    assert!(line.starts_with("0 2048 thin-pool 5 "), "{line}");
    assert!(
        line.ends_with(" 3/16 - rw discard_passdown queue_if_no_space - 512"),
        "{line}"
    );
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, BLOCK, 0x13, "block 0 → data block 3");
    expect_bytes(&vol, BLOCK, BLOCK, 0x14, "block 1 → data block 4");
    expect_bytes(&vol, 2 * BLOCK, 8 * BLOCK, 0, "unmapped");
    expect_bytes(&vol, 10 * BLOCK, BLOCK, 0x17, "block 10 → data block 7");
    expect_bytes(
        &contents(&daemon, "snap"),
        0,
        BLOCK,
        0x13,
        "device 4 shares block 3",
    );
    assert_eq!(status_line_of(&daemon, "vol"), "384 1407");
    // A write to the block device 4 shares breaks the sharing; device 4 keeps its data.
    fill(&daemon, "vol", 0xee, 4 * KIB, 4 * KIB);
    expect_bytes(
        &contents(&daemon, "snap"),
        0,
        BLOCK,
        0x13,
        "device 4 after the write",
    );
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 4 * KIB, 0x13, "copied");
    expect_bytes(&vol, 4 * KIB, 4 * KIB, 0xee, "written");
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["remove", "snap"]);
    daemon.udm(&["remove", "pool"]);
    thin_check(&meta);
}
