#!/usr/bin/env bash
# Builds what a GPU sitting runs (scripts/gpu-sitting.sh) on a machine without
# a GPU and packs it, stripped, into one folder to carry to the GPU host: zrun
# and zworker built with the `cuda` feature, and the test executables that
# hold the GPU to its oracles (zcuda's kernels and model, zengine's optimizer
# kernels, tests/gpu.rs's training runs). About 25 MB; the GPU host then
# needs no Rust toolchain and no build time (its device minutes are few).
#
#   scripts/gpu-pack.sh [DIR]      # default .gpu (ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu}
artifacts=$(mktemp)
trap 'rm -f "$artifacts"' EXIT
cargo test --release --workspace --features zworker/cuda --lib --test gpu --no-run \
  --message-format=json-render-diagnostics > "$artifacts"
cargo build --release --features zworker/cuda
# target/release's layout: the e2e tests find zrun beside their deps/ folder.
rm -rf "$dir" && mkdir -p "$dir/release/deps"
for b in zrun zworker; do
  strip -o "$dir/release/$b" "target/release/$b"
done
# package-folder:target-name of each test executable, as check-cuda.sh finds them.
for want in zcuda:zcuda zengine:zengine tests:gpu; do
  exe=$(python3 scripts/test_exe.py "${want%%:*}" "${want##*:}" "$artifacts")
  strip -o "$dir/release/deps/${want##*:}" "$exe"
done
# The e2e tests run zrun in the folder they were built in. Cargo names a
# workspace's path packages by their place in it, so a worktree building
# into this target/ (a pack of an older commit) leaves executables that
# cargo reuses here, pointing at the worktree: build such packs into a
# target folder of their own (CARGO_TARGET_DIR).
if ! grep -aq "$PWD/tests" "$dir/release/deps/gpu"; then
  echo "$dir/release/deps/gpu was built in another checkout, not $PWD: touch tests/gpu.rs and pack again," \
    "and give other checkouts their own CARGO_TARGET_DIR" >&2
  exit 1
fi
git rev-parse --short HEAD > "$dir/commit"
pwd > "$dir/repo"   # where the e2e tests look for the repository
du -sh "$dir"
echo "carry $dir to the GPU host and run: scripts/gpu-sitting.sh $dir"
