#!/usr/bin/env bash
# In the guest, as root: Linux's dm-snapshot takes over a persistent COW store udm wrote (origin
# DISK_ORIGIN, COW DISK_COW), reports what it finds, then writes to the origin and the snapshot.
# Into RESULTS: {before,after}.snapshot (dmsetup status of the snapshot without "start len
# type"), {before,after}.sha.{origin,snapshot} (sha256 of each device's content).
# Usage: snapshot_guest.sh RESULTS DISK_ORIGIN DISK_COW CHUNK_SECTORS
set -euo pipefail
results=$1 origin=$2 cow=$3 chunk=$4
modprobe dm-snapshot
sectors=$(blockdev --getsz "$origin")
dmsetup create korigin --table "0 $sectors snapshot-origin $origin"
dmsetup create ksnap --table "0 $sectors snapshot $origin $cow P $chunk"

record() {
  dmsetup status ksnap | cut -d' ' -f4- > "$results/$1.snapshot"
  sha256sum < /dev/mapper/korigin | cut -d' ' -f1 > "$results/$1.sha.origin"
  sha256sum < /dev/mapper/ksnap | cut -d' ' -f1 > "$results/$1.sha.snapshot"
}
# Writes LEN bytes of BYTE (octal) at OFFSET (both in 64 KiB units) straight to DEVICE.
fill() {
  head -c $(($4 * 65536)) /dev/zero | tr '\0' "\\$2" \
    | dd of="/dev/mapper/$1" bs=64K seek="$3" oflag=direct conv=fsync status=none
}

record before
fill korigin 061 32 2     # '1' at 2 MiB: chunks saved into the snapshot first
fill ksnap 062 64 1       # '2' at 4 MiB, on the snapshot alone
record after
dmsetup remove ksnap
dmsetup remove korigin
