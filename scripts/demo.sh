#!/usr/bin/env bash
# udm's main job on an embedded default, from nothing: clone a slow source volume onto fast
# local storage while it is already in use, watch it hydrate, and finish it live.
#
# Builds udm, makes a 256 MiB ext4 image of this repository's files as the source, slows it
# down to 1 ms per read with a `delay` device, clones it with the `clone` target, uses the
# clone at once (reads and verified writes over NBD), waits for hydration with a progress
# bar, then swaps the clone for `linear <destination>` without disconnecting anyone.
# Everything lives in $UDM_DEMO_DIR (default /tmp/udm-demo), removed at the end unless KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo build --release --locked -p udm
UDM=$PWD/target/release/udm
DIR=${UDM_DEMO_DIR:-/tmp/udm-demo}
rm -rf "$DIR"; mkdir -p "$DIR"
export UDM_CONTROL=$DIR/control.sock
SOCK=$DIR/nbd.sock
URI="nbd+unix:///vol?socket=$SOCK"
cleanup() {
  [ -n "${DAEMON:-}" ] && kill "$DAEMON" 2>/dev/null && wait "$DAEMON" 2>/dev/null
  [ "${KEEP:-0}" = 1 ] || rm -rf "$DIR"
}
trap cleanup EXIT
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "The source: a 256 MiB ext4 image holding this repository's files"
mkdir -p "$DIR/tree" && cp -r crates docs scripts README.md "$DIR/tree/"
truncate -s 256M "$DIR/source.img"
mkfs.ext4 -q -F -d "$DIR/tree" "$DIR/source.img"
fallocate -l 256M "$DIR/fast.img"         # the destination, preallocated (README: why)
truncate -s 4M "$DIR/meta.img"            # all zero: the clone formats it

step "Start the daemon"
"$UDM" daemon --state-dir "$DIR/state" --nbd "unix:$SOCK" 2>"$DIR/daemon.log" &
DAEMON=$!
for _ in $(seq 100); do "$UDM" ls >/dev/null 2>&1 && break; sleep 0.05; done

step "Make the source slow (1 ms per read) and clone it onto fast.img (64 KiB regions)"
"$UDM" create slow-source --table "0 524288 delay $DIR/source.img 0 1 $DIR/source.img 0 0"
"$UDM" create vol --table "0 524288 clone $DIR/meta.img $DIR/fast.img slow-source 128 \
0 6 hydration_threshold 256 hydration_batch_size 16 max_hydration_rate 40960"
"$UDM" ls --tree
"$UDM" status vol

step "Use it at once: the whole volume reads back identical to the source while it hydrates"
qemu-img compare -f raw -F raw "$DIR/source.img" "$URI"
echo "and fio writes (and verifies) 16 MiB at the end of the volume, which the ext4 image leaves unused"
fio --name=demo --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=16 \
    --offset=240M --size=16M --verify=crc32c --verify_state_save=0 --verify_fatal=1 --output-format=terse >/dev/null
"$UDM" status vol

step "Watch it hydrate (the background copy is capped at 40 MiB/s so there is something to see)"
"$UDM" wait vol --progress
"$UDM" status vol --json | sed -n '1,20p'

step "Finish: swap the clone for linear on the destination, live"
"$UDM" finalize vol
"$UDM" ls --tree
echo "the destination now holds the filesystem (and fio's data, still verifying):"
fio --name=demo --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=16 \
    --offset=240M --size=16M --verify=crc32c --verify_state_save=0 --verify_fatal=1 --verify_only --output-format=terse >/dev/null && echo "fio verify: ok"
e2fsck -fn "$DIR/fast.img"
step "Done (daemon log: $DIR/daemon.log; KEEP=1 keeps the directory)"
