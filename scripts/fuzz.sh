#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 20) with cargo-fuzz (libFuzzer).
# New inputs go to a scratch corpus; crashes are left in fuzz/artifacts/TARGET/ — copy each
# into fuzz/corpus/TARGET/ once fixed, and the corpus test replays it forever after.
# cargo-fuzz needs nightly features; RUSTC_BOOTSTRAP lets the stable toolchain provide them.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-20}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
status=0
for target in $(ls fuzz/fuzz_targets | sed 's/\.rs$//'); do
  mkdir -p "$SCRATCH/$target"
  echo "== fuzzing $target for ${SECONDS_PER_TARGET}s"
  if ! cargo fuzz run --fuzz-dir fuzz "$target" "$SCRATCH/$target" "fuzz/corpus/$target" -- \
      -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -print_final_stats=1 2>"$SCRATCH/$target.log"; then
    echo "fuzz target $target FAILED; log tail:"; tail -40 "$SCRATCH/$target.log"; status=1
  fi
  grep -E "stat::number_of_executed_units|stat::new_units_added" "$SCRATCH/$target.log" | sed "s/^/  $target /" || true
  echo "  $target corpus: $(ls "$SCRATCH/$target" | wc -l) new + $(ls "fuzz/corpus/$target" | wc -l) kept inputs"
done
exit $status
