#!/usr/bin/env bash
# Runs every test: unit tests beside the code, the conformance suite, and the end-to-end tests
# that start the real daemon and drive it with nbdinfo, qemu-img, qemu-io, nbdcopy and fio.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo test --workspace --locked "$@"
