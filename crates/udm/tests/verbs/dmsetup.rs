//! The command lines dmsetup users type, options and all, as scripts pass them.

use super::*;

/// Scripts pass dmsetup's udev options to every verb, and `--nolockfs`, `--showkeys`, `-r`,
/// `status --noflush`, `mknodes` and `udevcomplete_all` where dmsetup takes them: none of
/// them means anything without kernel device nodes, and udm refused each as an unexpected
/// argument (or an unknown verb).
#[test]
fn dmsetup_options_for_udev_and_the_kernel_are_accepted() {
    let daemon = Daemon::start("udev-options");
    daemon.udm(&[
        "create",
        "-r",
        "--noudevsync",
        "z",
        "--table",
        "0 2048 zero",
    ]);
    assert!(
        daemon.udm(&["info", "z"]).contains("ACTIVE (READ-ONLY)"),
        "-r"
    );
    daemon.udm(&["-v", "--verifyudev", "suspend", "--nolockfs", "z"]);
    daemon.udm(&["resume", "-y", "z"]);
    assert_eq!(daemon.udm(&["table", "--showkeys", "z"]), "0 2048 zero");
    assert_eq!(daemon.udm(&["status", "--noflush", "z"]), "0 2048 zero");
    assert_eq!(daemon.udm(&["mknodes", "z"]), "");
    assert_eq!(daemon.udm(&["mknodes"]), "");
    let err = daemon.udm_err(&["mknodes", "nothing"]);
    assert!(err.contains("'nothing'"), "{err}");
    daemon.udm(&["udevcomplete_all"]);
    daemon.udm(&["remove", "--noudevsync", "-v", "z"]);
}

/// dmsetup takes a list of devices for `suspend`, `resume`, `remove` and `mknodes` (`dmsetup
/// remove a b c`, what teardown scripts run), and goes on past one that fails. udm took one
/// name and refused the second as an unexpected argument.
#[test]
fn suspend_resume_and_remove_take_a_list_of_devices_as_with_dmsetup() {
    let daemon = Daemon::start("device-lists");
    for name in ["a", "b", "c"] {
        daemon.create(name, "0 2048 zero");
    }
    daemon.udm(&["suspend", "a", "b"]);
    for name in ["a", "b"] {
        assert!(daemon.udm(&["info", name]).contains("SUSPENDED"), "{name}");
    }
    daemon.udm(&["resume", "a", "b"]);
    assert!(daemon.udm(&["info", "a"]).contains("ACTIVE"));
    daemon.udm(&["mknodes", "a", "b"]);
    // The device that is not there fails alone, in one line naming it; the others go.
    let err = daemon.udm_err(&["remove", "a", "nothing", "b"]);
    assert!(err.contains("'nothing'"), "{err}");
    assert_eq!(daemon.udm(&["ls"]), "c\t(2048 sectors)");
}

/// dmsetup takes a list of devices for `info`, `status`, `table` and `deps` too, and marks each
/// device's lines with `NAME: ` (info's blocks set apart by a blank line; `info -c` under one
/// heading). udm refused the second name as an unexpected argument.
#[test]
fn listings_take_a_list_of_devices_as_with_dmsetup() {
    let daemon = Daemon::start("listing-lists");
    daemon.create("a", "0 2048 zero");
    daemon.create("b", "0 4096 error");
    daemon.create("c", "0 2048 zero");
    assert_eq!(
        daemon.udm(&["table", "b", "a"]),
        "b: 0 4096 error\na: 0 2048 zero"
    );
    assert_eq!(
        daemon.udm(&["status", "a", "b", "--target", "zero"]),
        "a: 0 2048 zero"
    );
    assert_eq!(
        daemon.udm(&["deps", "a", "b"]),
        "a: 0 dependencies\t:\nb: 0 dependencies\t:"
    );
    let info = daemon.udm(&["info", "a", "b"]);
    assert!(info.starts_with("Name:              a\n"), "{info}");
    assert!(info.contains("\n\nName:              b\n"), "{info}");
    assert_eq!(
        daemon.udm(&["info", "-c", "-o", "name,sectors", "--noheadings", "a", "c"]),
        "a:2048\nc:2048"
    );
    assert_eq!(
        daemon
            .udm(&["info", "--json", "a", "c"])
            .matches("\"name\"")
            .count(),
        2
    );
    let err = daemon.udm_err(&["table", "a", "nothing"]);
    assert!(err.contains("'nothing'"), "{err}");
}

/// `dmsetup create --notable NAME` (`-n`) makes a device to load a table into later; a udm
/// device is made with its table, and says so in one line (udm answered "unexpected argument
/// '--notable' (a similar argument exists: '--table')"). `wait --noflush`, which asks for a
/// thin pool's status without a commit, is accepted: udm's status commits nothing.
#[test]
fn create_notable_is_refused_saying_why_and_wait_takes_noflush() {
    let daemon = Daemon::start("notable");
    for flag in ["--notable", "-n"] {
        let err = daemon.udm_err(&["create", flag, "x"]);
        assert!(err.contains("is made with its table"), "{err}");
    }
    assert_eq!(daemon.udm(&["ls"]), "No devices found");
    let path = daemon.sparse("path.img", MIB);
    let path = path.to_str().unwrap();
    daemon.create(
        "mp",
        &format!("0 2048 multipath 0 0 1 1 round-robin 0 1 1 {path} 1"),
    );
    daemon.udm(&["message", "mp", "0", "fail_path", path]);
    let event = daemon.event_nr("mp");
    assert!(event > 0);
    daemon.udm(&["wait", "--noflush", "mp", &(event - 1).to_string()]);
}

/// dmsetup names a device by its UUID with `-u UUID` in every verb (`dmsetup remove -u
/// LVM-…`), as scripts that keep UUIDs do; udm refused `-u` outside `create`.
#[test]
fn dash_u_names_a_device_by_its_uuid_in_every_verb() {
    let daemon = Daemon::start("dash-u");
    daemon.udm(&["create", "-u", "UDM-z-1", "z", "--table", "0 2048 zero"]);
    assert!(daemon
        .udm(&["info", "-u", "UDM-z-1"])
        .contains("Name:              z"));
    assert_eq!(daemon.udm(&["table", "--uuid=UDM-z-1"]), "0 2048 zero");
    daemon.udm(&["suspend", "--uuid", "UDM-z-1"]);
    daemon.udm(&["resume", "-u", "UDM-z-1"]);
    daemon.udm(&[
        "--control",
        daemon.control().to_str().unwrap(),
        "remove",
        "-f",
        "-u",
        "UDM-z-1",
    ]);
    assert_eq!(daemon.udm(&["ls"]), "No devices found");
}

/// `dmsetup wipe_table NAME…`, what teardown scripts run before `remove`: an `error` table as
/// large as the device goes live, failing new I/O and letting go of the files the old table
/// used. udm had no such verb.
#[test]
fn wipe_table_makes_an_error_table_live_as_with_dmsetup() {
    let daemon = Daemon::start("wipe-table");
    daemon.create_linear("a", "a.img", MIB);
    daemon.create("b", "0 4096 zero");
    daemon.udm(&["create", "-u", "UDM-c", "c", "--table", "0 8 zero"]);
    daemon.udm(&["wipe_table", "a", "b", "--noflush", "--nolockfs"]);
    daemon.udm(&["wipe_table", "-u", "UDM-c"]);
    assert_eq!(
        daemon.udm(&["table", "a", "b", "c"]),
        "a: 0 2048 error\nb: 0 4096 error\nc: 0 8 error"
    );
    assert_eq!(daemon.udm(&["deps", "a"]), "0 dependencies\t:");
    qemu_io_eio(&daemon.uri("b"), "read 0 4k");
    let err = daemon.udm_err(&["wipe_table", "nothing"]);
    assert!(err.contains("'nothing'"), "{err}");
}

/// `create --readahead auto --addnodeoncreate` and `resume --addnodeonresume`, as LVM-era
/// scripts pass them, set what only a kernel block device has, and are accepted; a device
/// named by `-j MAJOR -m MINOR` cannot be, and the error says why instead of udm's
/// "unexpected argument '-j'".
#[test]
fn block_device_options_are_accepted_and_device_numbers_refused_saying_why() {
    let daemon = Daemon::start("block-device-options");
    daemon.udm(&[
        "create",
        "--readahead",
        "auto",
        "--addnodeoncreate",
        "z",
        "--table",
        "0 8 zero",
    ]);
    daemon.udm(&["suspend", "z"]);
    daemon.udm(&["resume", "--addnodeonresume", "--readahead", "256", "z"]);
    for args in [
        &["info", "-j", "253", "-m", "0"][..],
        &["remove", "--major", "253"],
    ] {
        let err = daemon.udm_err(args);
        assert!(err.contains("no major and minor numbers"), "{err}");
    }
    assert_eq!(daemon.udm(&["ls"]), "z\t(8 sectors)");
}

/// `dmsetup splitname VG-LV` splits an LVM name into its volume group, volume and layer (a
/// doubled `-` stands for `-`), as LVM's scripts run it, and `info -c -o vg_name,lv_name`
/// shows the same of each device. udm had no such verb and suggested `rename`.
#[test]
fn splitname_splits_lvm_names_as_dmsetup_does() {
    let daemon = Daemon::start("splitname");
    assert_eq!(
        daemon.udm(&["splitname", "vg00-lv--home-real"]),
        "VG   LV      LVLayer\nvg00 lv-home real"
    );
    let fields = ["-o", "lv_name,vg_name", "--noheadings", "--separator", ":"];
    assert_eq!(
        daemon.udm(&[&["splitname", "a--b-c"][..], &fields].concat()),
        "c:a-b"
    );
    daemon.create("vg-lv", "0 8 zero");
    let fields = "name,vg_name,lv_name,lv_layer";
    assert_eq!(
        daemon.udm(&["info", "-c", "--noheadings", "-o", fields]),
        "vg-lv:vg:lv:"
    );
    let err = daemon.udm_err(&["splitname", "x-y", "MD"]);
    assert!(err.contains("'MD'"), "{err}");
}

/// `dmsetup deps -o devname`, how scripts find the disks under a device, prints what udm's
/// `deps` prints (names, not numbers); `-o devno` and `-o blkdevname` ask for kernel device
/// numbers and names, and are refused saying so. udm refused `-o` as an unexpected argument.
#[test]
fn deps_takes_dmsetups_o_devname() {
    let daemon = Daemon::start("deps-devname");
    daemon.create("z", "0 8 zero");
    daemon.create("top", "0 8 linear z 0");
    assert_eq!(
        daemon.udm(&["deps", "-o", "devname", "top"]),
        "1 dependencies\t: (z)"
    );
    for kernel in ["devno", "blkdevname"] {
        let err = daemon.udm_err(&["deps", "-o", kernel, "top"]);
        assert!(err.contains("not kernel block devices"), "{err}");
    }
}

/// `--nameprefixes` makes each field `DM_FIELD='value'`, for scripts to `eval` (`eval $(dmsetup
/// splitname --nameprefixes --noheadings NAME)`, `dmsetup info -c --nameprefixes …`). udm
/// refused it as an unexpected argument.
#[test]
fn nameprefixes_give_each_field_its_shell_name_as_dmsetup_does() {
    let daemon = Daemon::start("nameprefixes");
    daemon.udm(&["create", "-u", "U-1", "vg-lv", "--table", "0 8 zero"]);
    let prefixed = ["--nameprefixes", "--noheadings"];
    assert_eq!(
        daemon.udm(&[&["info", "-o", "name,uuid,open"][..], &prefixed].concat()),
        "DM_NAME='vg-lv':DM_UUID='U-1':DM_OPEN='0'"
    );
    assert_eq!(
        daemon.udm(&[&["splitname", "my--vg-lv"][..], &prefixed].concat()),
        "DM_VG_NAME='my-vg':DM_LV_NAME='lv':DM_LV_LAYER=''"
    );
}

/// dmsetup reads its options anywhere, before the verb too (`dmsetup -f remove vol`, `dmsetup
/// -c info`, `dmsetup -u UUID info`); udm refused a verb's option before the verb.
#[test]
fn a_verbs_options_may_come_before_it_as_with_dmsetup() {
    let daemon = Daemon::start("options-first");
    daemon.udm(&["-u", "U-1", "create", "z", "--table", "0 8 zero"]);
    assert_eq!(
        daemon.udm(&["-o", "name,uuid", "--noheadings", "info", "z"]),
        "z:U-1"
    );
    assert_eq!(daemon.udm(&["-u", "U-1", "table"]), "0 8 zero");
    let _client = RawClient::connect(&daemon.nbd_socket(), "z");
    daemon.udm(&["-f", "remove", "z"]);
    assert_eq!(daemon.udm(&["ls"]), "No devices found");
}
