#!/usr/bin/env bash
# In the guest, as root: every check's guest part, in one boot. Disks: /dev/vda and /dev/vdb a
# thin pool's metadata and data, /dev/vdc and /dev/vdd a snapshot's origin and COW store.
# Usage: guest.sh RESULTS THIN_POOL_REST THIN_VOLUME_SECTORS "THIN IDS" "THIN IDS AFTER" CHUNK
set -euo pipefail
here=$(dirname "$0")
bash "$here/thin_guest.sh" "$1" "$2" "$3" "$4" "$5"
bash "$here/snapshot_guest.sh" "$1" /dev/vdc /dev/vdd "$6"
