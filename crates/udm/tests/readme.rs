//! The README's tour as a test, so that it stays true: every ```sh block from "## A five-minute
//! tour" up to "## Security" runs, in order, as one bash script (`set -euo pipefail`) in a
//! scratch directory, with the udm under test first on the PATH. The only changes to the text:
//! `/tmp/tour` becomes the scratch directory and `cargo build` is left out (the test's binary is
//! built already). Blocks fenced as plain ``` (the install commands of "Running udm at boot")
//! and everything outside those sections are not run. A few outputs the README shows in
//! comments are checked against what the commands printed.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

const README: &str = include_str!("../../../README.md");
const FIRST: &str = "## A five-minute tour";
const LAST: &str = "## Security";

/// The tour's ```sh blocks, as lines.
fn tour_lines() -> Vec<&'static str> {
    let start = README.find(FIRST).expect("the tour section");
    let end = README[start..].find(LAST).expect("the security section") + start;
    let mut lines = Vec::new();
    let mut in_sh = false;
    for line in README[start..end].lines() {
        match (in_sh, line.trim_end()) {
            (false, "```sh") => in_sh = true,
            (true, "```") => in_sh = false,
            (true, _) => lines.push(line),
            _ => {}
        }
    }
    assert!(!in_sh, "an unterminated ```sh block in the tour");
    lines
}

/// The README's comment on the line that runs `command` (what it says the command prints).
fn comment_on(command: &str) -> String {
    let line = tour_lines()
        .into_iter()
        .find(|l| {
            l.split_once(" # ")
                .is_some_and(|(c, _)| c.trim_end() == command)
        })
        .unwrap_or_else(|| panic!("no `{command}` in the tour"));
    line.split_once("# ").expect("a comment").1.to_string()
}

/// Leaves nothing behind if the tour stopped halfway: the daemon, a loop device, a mount.
struct Cleanup<'a>(&'a Path);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let dir = self.0;
        let _ = Command::new("umount").arg(dir.join("mnt")).status();
        for device in ["fast", "lw"] {
            let file = dir.join("fuse").join(device);
            let out = Command::new("losetup").arg("-j").arg(&file).output();
            if let Ok(out) = out {
                for line in String::from_utf8_lossy(&out.stdout).lines() {
                    if let Some((loop_device, _)) = line.split_once(':') {
                        let _ = Command::new("losetup").args(["-d", loop_device]).status();
                    }
                }
            }
        }
        let _ = Command::new(UDM)
            .arg("stop")
            .env("UDM_CONTROL", dir.join("control.sock"))
            .output();
    }
}

#[test]
fn the_readme_tour_runs_as_written() {
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "the tour mounts a filesystem: run as root"
    );
    let dir = TempDir::new("readme");
    let scratch = dir.path("tour");
    let tour = scratch.display().to_string();
    let bin = Path::new(UDM).parent().unwrap().display().to_string();
    // Lines whose output the README shows are copied into checks/ as they run.
    let checked = ["udm status fast", "udm deps top", "udm status clone"];
    let mut script =
        format!("set -euo pipefail\nexport PATH={bin}:$PATH\nmkdir -p {tour}/checks\n");
    for line in tour_lines() {
        if line.starts_with("cargo build") {
            continue;
        }
        let line = line.replace("/tmp/tour", &tour);
        let command = line
            .split_once(" # ")
            .map_or(line.as_str(), |(c, _)| c)
            .trim_end();
        match checked.iter().position(|c| command == *c) {
            Some(i) => script += &format!("{command} | tee {tour}/checks/{i}\n"),
            None => script += &format!("{line}\n"),
        }
    }
    std::fs::write(dir.path("tour.sh"), &script).unwrap();
    let _cleanup = Cleanup(&scratch);
    // Output goes to a file, not a pipe: a daemon the tour started keeps the descriptors it
    // inherited, so a tour that fails before `udm stop` would leave a pipe open and the test
    // waiting for its end for ever.
    let output = std::fs::File::create(dir.path("tour.out")).unwrap();
    let status = Command::new("timeout")
        .args(["600", "bash"])
        .arg(dir.path("tour.sh"))
        .current_dir(&dir.0)
        .stdout(output.try_clone().unwrap())
        .stderr(output)
        .status()
        .unwrap();
    let log = std::fs::read_to_string(scratch.join("udm.log")).unwrap_or_default();
    assert!(
        status.success(),
        "the tour failed ({status}):\n{}\ndaemon log:\n{log}",
        std::fs::read_to_string(dir.path("tour.out")).unwrap_or_default()
    );
    let printed = |i: usize| {
        std::fs::read_to_string(scratch.join(format!("checks/{i}")))
            .unwrap()
            .trim_end()
            .to_string()
    };
    assert_eq!(
        printed(0),
        comment_on(checked[0]).replace("/tmp/tour", &tour)
    );
    assert_eq!(printed(1), comment_on(checked[1]));
    // The clone's status: what a 4 MiB metadata file gives for this volume, whatever has been
    // copied by then (the hydrated count and the regions in flight vary).
    let (said, shown) = (printed(2), comment_on(checked[2]));
    let fields = |s: &str| -> Vec<String> { s.split_whitespace().map(str::to_string).collect() };
    let (said, shown) = (fields(&said), fields(&shown));
    assert_eq!(said.len(), shown.len(), "{said:?} vs {shown:?}");
    for (i, (a, b)) in said.iter().zip(&shown).enumerate() {
        if i == 6 {
            assert_eq!(a.split('/').nth(1), b.split('/').nth(1), "total regions");
        } else if i != 7 {
            assert_eq!(a, b, "field {i} of {said:?}");
        }
    }
}
