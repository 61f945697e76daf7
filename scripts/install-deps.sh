#!/usr/bin/env bash
# Installs the real clients and peers that udm's tests and benchmarks drive (Debian packages).
# Does nothing when they are all present already.
set -euo pipefail
need=()
for pair in fio:fio nbdkit:nbdkit nbdinfo:libnbd-bin nbdcopy:libnbd-bin nbdfuse:libnbd-bin \
            qemu-img:qemu-utils qemu-io:qemu-utils qemu-nbd:qemu-utils fusermount3:fuse3 \
            mkfs.xfs:xfsprogs mkfs.ext4:e2fsprogs nbdsh:python3-libnbd openssl:openssl \
            thin_check:thin-provisioning-tools; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $(printf '%s\n' "${need[@]}" | sort -u) >/dev/null
fi
