#!/usr/bin/env bash
# udm's main job on an embedded default, from nothing: build udm, make a source image, start
# the daemon, build a stack of targets over it, and reach it with real clients.
# Everything lives in a scratch directory ($UDM_DEMO_DIR, default /tmp/udm-demo) that is
# removed at the end unless KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo build --release --locked -p udm
UDM=$PWD/target/release/udm
DIR=${UDM_DEMO_DIR:-/tmp/udm-demo}
rm -rf "$DIR"; mkdir -p "$DIR"
export UDM_CONTROL=$DIR/control.sock
SOCK=$DIR/nbd.sock
cleanup() {
  [ -n "${DAEMON:-}" ] && kill "$DAEMON" 2>/dev/null && wait "$DAEMON" 2>/dev/null
  [ "${KEEP:-0}" = 1 ] || rm -rf "$DIR"
}
trap cleanup EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "A 256 MiB source image with an ext4 filesystem of the repository's files"
mkdir -p "$DIR/tree" && cp -r crates docs "$DIR/tree/" 2>/dev/null || true
truncate -s 256M "$DIR/source.img"
mkfs.ext4 -q -F -d "$DIR/tree" "$DIR/source.img"
truncate -s 256M "$DIR/fast.img"

step "Start the daemon"
"$UDM" daemon --state-dir "$DIR/state" --nbd "unix:$SOCK" 2>"$DIR/daemon.log" &
DAEMON=$!
for _ in $(seq 100); do "$UDM" ls >/dev/null 2>&1 && break; sleep 0.05; done

step "Build a stack: a slow source (1 ms reads), and a volume on fast.img"
"$UDM" create slow-source --table "0 524288 delay $DIR/source.img 0 1"
"$UDM" create vol --table "0 524288 linear $DIR/fast.img 0"
"$UDM" ls --tree

step "Copy the slow source onto the volume with qemu-img, over NBD"
time qemu-img convert -p -n -f raw -O raw "nbd+unix:///slow-source?socket=$SOCK" "nbd+unix:///vol?socket=$SOCK"
qemu-img compare -f raw -F raw "$DIR/source.img" "nbd+unix:///vol?socket=$SOCK"

step "What the clients see"
nbdinfo "nbd+unix:///vol?socket=$SOCK" | sed -n '1,12p'
nbdinfo --map "nbd+unix:///slow-source?socket=$SOCK" | head -5

step "Swap the volume's table live for an equivalent one in two segments, while fio verifies it"
fio --name=demo --ioengine=nbd --uri="nbd+unix:///vol?socket=$SOCK" --rw=randrw --bs=4k \
    --iodepth=16 --size=64M --offset=192M --verify=crc32c --time_based --runtime=3 \
    --output-format=terse --terse-version=3 >"$DIR/fio.terse" &
FIO=$!
sleep 1
"$UDM" suspend vol
"$UDM" load vol --table "0 262144 linear $DIR/fast.img 0
262144 262144 linear $DIR/fast.img 262144"
"$UDM" info vol
"$UDM" resume vol
if wait $FIO; then echo "fio: no errors across the swap"; else echo "fio reported errors" >&2; exit 1; fi
"$UDM" table vol
"$UDM" status vol
step "Done (logs in $DIR/daemon.log; KEEP=1 keeps the directory)"
