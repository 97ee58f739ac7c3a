#!/usr/bin/env bash
# Builds this checkout's zworker with the `cuda` feature, stripped, as
# DIR/zworker-NAME (~7 MB, under a minute after a kernel change): one
# variant for `scripts/gpu-sitting.sh PACK variants DIR`, which runs each
# variant's zworker beside the pack's zrun and times them against each
# other, kernel by kernel and step by step. So a GPU change can be timed
# before it is committed: build the tree as it is (the baseline), make the
# change, build again under another name, undo it; commit only what the
# sitting shows faster. Every variant is built the same way (one package,
# so the same features), the baseline too.
#
#   scripts/gpu-variant.sh NAME [DIR]      # default DIR .gpu-variants (ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: scripts/gpu-variant.sh NAME [DIR]}
dir=${2:-.gpu-variants}
[[ $name =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "a variant's name is letters, digits, '.', '_' or '-': $name" >&2; exit 2; }
mkdir -p "$dir"
cargo build --release --features zworker/cuda -p zworker
strip -o "$dir/zworker-$name" target/release/zworker
# What the variant is: the commit and the change on top of it.
{ echo "$name: $(git rev-parse --short HEAD)"; git diff --stat; } > "$dir/zworker-$name.txt"
du -sh "$dir"
