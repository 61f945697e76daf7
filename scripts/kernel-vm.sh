#!/usr/bin/env bash
# Runs a command as root inside a guest that boots Linux's own kernel (Debian's 6.12), so that
# the kernel's device-mapper, nbd and ublk can judge what udm does. The guest shares the host's
# files (read-only but for the results folder); the images given with --disk are its virtio
# disks /dev/vda, /dev/vdb, … in order (not loop devices over the shared folder: loop over 9p
# crashed a guest here).
#
#   scripts/kernel-vm.sh [--disk FILE]… [--results DIR] [--timeout SECONDS] -- COMMAND [ARG]…
#   scripts/kernel-vm.sh --check      # installs what a guest needs; exit 77 if none can boot
#
# COMMAND runs in the guest in this checkout's folder; its output is this script's output and
# its exit status this script's. Exit 77 (and one line saying why) when no guest can boot here:
# no kernel package, qemu or virtme-ng to be had. Installs what it needs the first time (Debian
# packages qemu-system-x86, busybox-static, dmsetup and the newest linux-image-6.12.*-amd64,
# unpacked without an initramfs; virtme-ng in a venv at $UDM_VNG_VENV, /opt/udm-vng by default).
#
# The guest runs under TCG (software emulation): KVM fails on this project's CI machines (a
# nested "KVM internal error"). On a host where KVM works, UDM_KERNEL_KVM=1 uses it and the
# boot takes seconds instead of about 35 s. Timings taken in a TCG guest mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
venv=${UDM_VNG_VENV:-/opt/udm-vng}
skip() { echo "kernel-vm: skipped: $*" >&2; exit 77; }

disks=() results="" timeout=600 check_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --disk) disks+=("$(realpath "$2")"); shift 2 ;;
    --results) results=$(realpath "$2"); shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --check) check_only=1; shift ;;
    --) shift; break ;;
    *) echo "kernel-vm: unknown option '$1' (see the comment at the top of $0)" >&2; exit 2 ;;
  esac
done

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
# --no-remove: a package that would replace one the tests use is not installed at all.
apt_install() {
  $SUDO apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-remove "$@" >/dev/null 2>&1
}

# qemu-system-x86 at the version of the qemu-utils the tests use: Debian's own 7.2 would
# remove a newer qemu-utils (the machines here carry 10.0 from bookworm-backports).
install_qemu() {
  local utils
  utils=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
  if [[ "$utils" == *bpo12* ]] && ! grep -rqs bookworm-backports /etc/apt/sources.list*; then
    echo "deb http://deb.debian.org/debian bookworm-backports main" \
      | $SUDO tee /etc/apt/sources.list.d/udm-backports.list >/dev/null
  fi
  apt_install busybox-static dmsetup ${utils:+"qemu-system-x86=$utils"} \
    || apt_install busybox-static dmsetup qemu-system-x86
}

newest_kernel() {
  ls /boot/vmlinuz-6.12.*-amd64 2>/dev/null | sort -V | tail -n 1
}

# The kernel package is unpacked, not installed: installing it builds an initramfs for the
# host (minutes of CPU) that the guest does not use (virtme-ng boots the host's root directly).
install_kernel() {
  local pkg dir
  apt-get update -qq >/dev/null 2>&1 || true
  pkg=$(apt-cache search --names-only '^linux-image-6\.12\.[0-9]+\+deb[0-9]+-amd64-unsigned$' \
        | cut -d' ' -f1 | sort -V | tail -n 1)
  [ -n "$pkg" ] || return 1
  dir=$(mktemp -d)
  (cd "$dir" && apt-get download -qq "$pkg" >/dev/null 2>&1) || { rm -rf "$dir"; return 1; }
  $SUDO dpkg-deb -x "$dir"/*.deb /
  rm -rf "$dir"
  local version=${pkg#linux-image-}; version=${version%-unsigned}
  $SUDO depmod -a "$version"
}

command -v qemu-system-x86_64 >/dev/null && command -v busybox >/dev/null \
  && command -v dmsetup >/dev/null \
  || install_qemu \
  || skip "cannot install qemu-system-x86 (at qemu-utils' version), busybox-static and dmsetup"
[ -n "$(newest_kernel)" ] || install_kernel || skip "no linux-image-6.12.*-amd64 package to be had"
if [ ! -x "$venv/bin/vng" ]; then
  { python3 -m venv "$venv" && "$venv/bin/pip" install -q 'virtme-ng==1.42'; } >/dev/null 2>&1 \
    || skip "cannot install virtme-ng (pip) into $venv"
fi
kernel=$(newest_kernel)
[ "$check_only" -eq 0 ] || { echo "kernel-vm: ready: $kernel"; exit 0; }
[ $# -gt 0 ] || { echo "kernel-vm: no command given (… -- COMMAND)" >&2; exit 2; }

results=${results:-$(mktemp -d)}
mkdir -p "$results"
status_file="$results/.kernel-vm-exit" booted_file="$results/.kernel-vm-booted"
rm -f "$status_file" "$booted_file"
options=(--run "$kernel" --memory 2G --cpus 2 --rw --rwdir "$results")
[ "${UDM_KERNEL_KVM:-0}" = 1 ] || options+=(--disable-kvm)
drives=""
for disk in "${disks[@]}"; do
  drives+=" -drive file=$disk,format=raw,if=virtio,cache=none"
done
[ -z "$drives" ] || options+=(--qemu-opts="$drives")
# The command's words, quoted for the guest's shell; its status goes to a file, as vng's own
# exit status does not always carry it.
quoted=$(printf '%q ' "$@")
inner="touch $(printf %q "$booted_file"); cd $(printf %q "$repo") && { $quoted; }; echo \$? > $(printf %q "$status_file")"
PATH="$venv/bin:$PATH" timeout --kill-after=10 "$timeout" \
  vng "${options[@]}" --exec "$inner" </dev/null || true
if [ ! -f "$status_file" ]; then
  [ -f "$booted_file" ] || skip "the guest did not boot within ${timeout}s"
  echo "kernel-vm: the guest booted but its command did not finish within ${timeout}s" >&2
  exit 1
fi
exit "$(cat "$status_file")"
