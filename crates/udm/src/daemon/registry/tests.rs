use udm_block::{AlignedBuf, BlockDevice};
use udm_testkit::TempDir;

use super::*;

fn error(result: Result<impl Sized>) -> String {
    match result {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// A hostile 1 MB name is refused in a line, not echoed back whole.
#[test]
fn errors_show_the_start_of_an_overlong_name_not_all_of_it() {
    let dir = TempDir::new("long-names");
    let r = Registry::in_scratch(&dir);
    let long = "é".repeat(1 << 19);
    for e in [
        error(r.create(&long, "0 8 zero", false, None)),
        error(r.resolve(&long)),
        error(r.suspend(&long, false)),
    ] {
        assert!(e.len() < 200, "{} bytes", e.len());
        assert!(
            e.contains(&format!("{}… (1048576 bytes)", "é".repeat(32))),
            "{e}"
        );
    }
    let e = error(r.create("x", "0 8 zero", false, Some(&"u".repeat(1 << 20))));
    assert!(e.contains("… (1048576 bytes)") && e.len() < 200, "{e}");
}

#[test]
fn no_device_may_come_to_depend_on_itself() {
    let dir = TempDir::new("cycles");
    let r = Registry::in_scratch(&dir);
    r.must_create("a", "0 2048 zero");
    r.must_create("b", "0 2048 linear a 0");
    r.must_create("c", "0 2048 linear b 0");
    for (text, through) in [
        ("0 2048 linear a 0", "a"),
        ("0 2048 linear b 0", "b"),
        ("0 2048 linear c 0", "c"),
    ] {
        let e = error(r.load("a", text, false, false));
        assert!(
            e.contains(&format!(
                "using device '{through}' would make 'a' depend on itself"
            )),
            "{e}"
        );
    }
    // An inactive table counts as a use too: once loaded it may become live.
    r.must_create("d", "0 2048 zero");
    r.load("d", "0 2048 linear c 0", false, false).unwrap();
    let e = error(r.load("a", "0 2048 linear d 0", false, false));
    assert!(e.contains("depend on itself"), "{e}");
    assert!(r.get("a").unwrap().inactive().is_none());
}

#[test]
fn a_device_in_use_is_neither_removed_nor_shrunk_under_its_users() {
    let dir = TempDir::new("holders");
    let r = Registry::in_scratch(&dir);
    r.must_create("base", "0 2048 zero");
    r.must_create("top", "0 1024 linear base 1024");
    assert_eq!(r.holders("base"), ["top"]);
    let e = error(r.remove("base", true, Duration::ZERO));
    assert!(e.contains("used by top"), "{e}");
    let e = error(r.load("base", "0 2047 zero", false, false));
    assert!(e.contains("'top' uses 2048 sectors of it"), "{e}");
    r.load("base", "0 2048 error", false, false).unwrap();
    r.load("base", "0 1024 zero", true, false).unwrap();
    r.remove("top", false, Duration::ZERO).unwrap();
    r.remove("base", false, Duration::ZERO).unwrap();
    assert!(r.all().is_empty());
}

#[test]
fn a_forced_remove_fails_the_io_of_whoever_still_has_it_open() {
    let dir = TempDir::new("force");
    let r = Registry::in_scratch(&dir);
    let device = r.must_create("vol", "0 2048 zero");
    let handle = device.open(false);
    let e = error(r.remove("vol", false, Duration::ZERO));
    assert!(e.contains("open by 1 client(s)"), "{e}");
    r.remove("vol", true, Duration::ZERO).unwrap();
    let err = device.read(0, &mut AlignedBuf::zeroed(4096)).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    drop(handle);
    assert!(r.get("vol").is_err());
}

/// A table the daemon swaps in itself (finalize, a forced remove) leaves the table the
/// user loaded meanwhile where it is.
#[test]
fn replacing_the_live_table_keeps_the_inactive_one() {
    let dir = TempDir::new("replace-live");
    let r = Registry::in_scratch(&dir);
    let device = r.must_create("vol", "0 8 zero");
    r.load("vol", "0 8 error", false, true).unwrap();
    device.replace_live(r.build("vol", "0 16 zero", false, device.events()).unwrap());
    assert_eq!(device.live().lines(), ["0 16 zero"]);
    assert_eq!(device.inactive().unwrap().lines(), ["0 8 error"]);
    assert!(device.inactive_read_only() && !device.read_only());
}

#[test]
fn names_are_checked() {
    let dir = TempDir::new("names");
    let r = Registry::in_scratch(&dir);
    for bad in ["", ".hidden", "-x", "a/b", "a b", &"n".repeat(128)] {
        let e = error(r.create(bad, "0 8 zero", false, None));
        assert!(e.contains("invalid device name"), "{bad}: {e}");
    }
    r.must_create("ok_1.2+3-4:5@6", "0 8 zero");
    let e = error(r.create("ok_1.2+3-4:5@6", "0 8 zero", false, None));
    assert!(e.contains("already exists"), "{e}");
}

/// Two devices' `snapshot` tables on one COW device were both let live, writing one store as
/// aliases. As the kernel, the second is a handover: `create` and `resume` are refused while
/// the first is live; once it is suspended the second takes over, and the first cannot come
/// back beside it.
#[test]
fn a_second_snapshot_table_on_a_live_cow_device_waits_for_a_handover() {
    let dir = TempDir::new("snapshot-handover");
    let (origin, cow) = (
        dir.sparse("origin.img", 1 << 22),
        dir.sparse("cow.img", 1 << 22),
    );
    let r = Registry::in_scratch(&dir);
    r.must_create(
        "base",
        &format!("0 8192 snapshot-origin {}", origin.display()),
    );
    let line = format!("0 8192 snapshot {} {} P 8", origin.display(), cow.display());
    r.must_create("snap", &line);
    let refused = "unable to perform snapshot handover until source is suspended: device 'snap'";
    let e = error(r.create("twin", &line, false, None));
    assert!(e.contains(refused), "{e}");
    assert!(r.get("twin").is_err());
    // Loading the table is allowed; its resume waits for the handover.
    r.must_create("twin", "0 8192 zero");
    r.load("twin", &line, false, false).unwrap();
    let e = error(r.resume("twin", false));
    assert!(e.contains(refused), "{e}");
    r.suspend("snap", false).unwrap();
    r.resume("twin", false).unwrap();
    let twin = r.get("twin").unwrap();
    twin.write(0, &AlignedBuf::zeroed(4096), Default::default())
        .unwrap();
    // The old table does not come back beside the new owner.
    let e = error(r.resume("snap", false));
    assert!(
        e.contains("until source is suspended: device 'twin'"),
        "{e}"
    );
    assert!(r.get("snap").unwrap().is_suspended());
}
