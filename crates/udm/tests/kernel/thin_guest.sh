#!/usr/bin/env bash
# In the guest, as root: Linux's dm-thin takes over a pool udm wrote (metadata /dev/vda, data
# /dev/vdb), reports what it finds, then works on it as a user would. Everything it sees goes
# to RESULTS for the host to compare with what udm said and served:
#   before.pool / after.pool            dmsetup status of the pool (without "start len type")
#   before.thinN / after.thinN          dmsetup status of thin device N
#   before.sha.N / after.sha.N          sha256 of thin device N's content
# Usage: thin_guest.sh RESULTS POOL_TABLE_REST VOLUME_SECTORS "IDS BEFORE" "IDS AFTER"
set -euo pipefail
results=$1 pool_rest=$2 sectors=$3 ids_before=$4 ids_after=$5
modprobe dm-thin-pool
data_sectors=$(blockdev --getsz /dev/vdb)
dmsetup create pool --table "0 $data_sectors thin-pool /dev/vda /dev/vdb $pool_rest"

status() { dmsetup status "$1" | cut -d' ' -f4-; }
activate() { dmsetup create "thin$1" --table "0 $sectors thin /dev/mapper/pool $1"; }
# Writes LEN bytes of BYTE (octal) at OFFSET (all in 64 KiB units) straight to the device.
fill() {
  head -c $(($4 * 65536)) /dev/zero | tr '\0' "\\$2" \
    | dd of="/dev/mapper/thin$1" bs=64K seek="$3" oflag=direct conv=fsync status=none
}
record() {
  local when=$1; shift
  for id in "$@"; do
    status "thin$id" > "$results/$when.thin$id"
    sha256sum < "/dev/mapper/thin$id" | cut -d' ' -f1 > "$results/$when.sha.$id"
  done
}

status pool > "$results/before.pool"
for id in $ids_before; do activate "$id"; done
record before $ids_before

# The kernel's turn: writes, a snapshot of a written device, a delete, a new device, a discard.
fill 1 167 96 4                                  # 'w' at 6 MiB
dmsetup suspend thin1
dmsetup message pool 0 "create_snap 6 1"
dmsetup resume thin1
fill 1 170 112 1                                 # 'x' at 7 MiB, after the snapshot
dmsetup remove thin4
dmsetup message pool 0 "delete 4"
dmsetup message pool 0 "create_thin 7"
activate 6
activate 7
fill 7 171 0 16                                  # 'y', the first MiB
blkdiscard -o 0 -l 1048576 /dev/mapper/thin2
sync
record after $ids_after
for id in $ids_after; do dmsetup remove "thin$id"; done
# Suspended, the pool has committed: its status is what the metadata on disk says.
dmsetup suspend pool
dmsetup status pool | cut -d' ' -f4- > "$results/after.pool"
dmsetup remove pool
