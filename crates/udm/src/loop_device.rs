//! `udm attach` and `udm detach`: a loop device over a device's file in the FUSE mount.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use crate::client;
use udm::control::Request;
use udm::daemon::loopback::{loop_backing, LoopBacking};

/// `losetup --direct-io=on -f --show` on the device's file in the daemon's FUSE mount.
pub fn attach(control: &Path, name: &str) -> anyhow::Result<()> {
    let response = client::call(
        control,
        Request::Info {
            name: Some(name.to_string()),
        },
    )?;
    let data = response.data.unwrap_or_default();
    let Some(file) = data["fuse_file"].as_str() else {
        bail!("the daemon has no FUSE mount: start it with --fuse MOUNTPOINT");
    };
    let mut args = vec!["--direct-io=on", "-f", "--show"];
    if data["read_only"].as_bool() == Some(true) {
        args.push("--read-only");
    }
    args.push(file);
    let out = std::process::Command::new("losetup")
        .args(&args)
        .output()
        .context("running losetup")?;
    if !out.status.success() {
        bail!(
            "losetup {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    out!("{}", String::from_utf8_lossy(&out.stdout));
    Ok(())
}

/// `losetup -d`, but only for a loop device of udm's: one whose backing file is in a udm FUSE
/// mount. Any other loop device is someone else's disk, and detaching it would pull it from
/// under them.
pub fn detach(loop_device: &Path) -> anyhow::Result<()> {
    let backing = loop_backing_file(loop_device)?;
    let in_udm_mount = match backing.parent() {
        Some(dir) => udm_fuse::is_udm_mount(dir)?,
        None => false,
    };
    if !in_udm_mount {
        bail!(
            "{} is not udm's: its backing file {} is not in a udm FUSE mount (use losetup -d)",
            loop_device.display(),
            backing.display()
        );
    }
    let out = std::process::Command::new("losetup")
        .arg("-d")
        .arg(loop_device)
        .output()
        .context("running losetup")?;
    if !out.status.success() {
        bail!(
            "losetup -d {}: {}",
            loop_device.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The file a loop device is bound to, as the kernel shows it in sysfs.
fn loop_backing_file(loop_device: &Path) -> anyhow::Result<PathBuf> {
    match loop_backing(loop_device).with_context(|| loop_device.display().to_string())? {
        LoopBacking::File(file) => Ok(file),
        LoopBacking::Detached => bail!("{} is not attached to a file", loop_device.display()),
        LoopBacking::NotALoopDevice => bail!("{} is not a loop device", loop_device.display()),
    }
}
