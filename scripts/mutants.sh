#!/usr/bin/env bash
# Mutation testing of the hot paths with cargo-mutants: plants one plausible bug
# at a time (an operator flipped, a function returning a default, a branch
# taken always) and reports the bugs no test noticed. Slow (a rebuild and a test
# run per mutant), so not part of CI; docs/TESTING.md has the counts.
#
#   scripts/mutants.sh            every set below
#   scripts/mutants.sh adam auth  only these sets
#
# Needs `cargo install cargo-mutants`. Results: target/mutants/<set>/mutants.out
# (missed.txt lists the survivors). Extra cargo-mutants flags go in
# MUTANTS_FLAGS, e.g. MUTANTS_FLAGS="--jobs 2" on a machine with the cores, or
# MUTANTS_FLAGS=--in-place to mutate this tree and reuse its build (much faster;
# leave the tree alone while it runs).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo-mutants >/dev/null || {
    echo "cargo-mutants is not installed: cargo install cargo-mutants" >&2
    exit 2
}

# name | package | files (cargo-mutants -f) | regex filter | test targets that judge
SETS=(
    "adam|zengine|crates/zengine/src/adam/mod.rs||--lib --test adamw_reference"
    "loss-scale|zengine|crates/zengine/src/precision.rs|LossScaler|--lib --test data_parallel"
    "auth|zproto|crates/zproto/src/auth.rs||"
    "collectives|zcomm|crates/zcomm/src/ring.rs crates/zcomm/src/pairwise.rs crates/zcomm/src/star.rs||"
    "shm|zcomm|crates/zcomm/src/shm.rs crates/zcomm/src/direct.rs||"
    "tcp|zcomm|crates/zcomm/src/tcp/mod.rs crates/zcomm/src/tcp/peers.rs crates/zcomm/src/tcp/handshake.rs crates/zcomm/src/links.rs||"
    "state|zengine|crates/zengine/src/state.rs||--test resume"
    "checkpoint|zckpt|crates/zckpt/src/lib.rs crates/zckpt/src/stream.rs||"
    "quant|zquant|crates/zquant/src/lib.rs||"
    "swap|zswap|crates/zswap/src/swapper.rs crates/zswap/src/dir.rs crates/zswap/src/buf.rs crates/zswap/src/lib.rs crates/zswap/src/threads.rs crates/zswap/src/uring.rs||"
)

wanted=("$@")
for set in "${SETS[@]}"; do
    IFS='|' read -r name package files filter targets <<<"$set"
    if [ ${#wanted[@]} -gt 0 ] && [[ ! " ${wanted[*]} " =~ " $name " ]]; then
        continue
    fi
    args=(-p "$package" --test-package "$package" --profile release)
    for f in $files; do args+=(-f "$f"); done
    [ -n "$filter" ] && args+=(--re "$filter")
    for t in $targets; do args+=("--cargo-test-arg=$t"); done
    out="target/mutants/$name"
    mkdir -p "$out"
    echo "== $name: cargo mutants ${args[*]}"
    # cargo-mutants exits 2 when mutants survive: report, do not stop.
    cargo mutants "${args[@]}" ${MUTANTS_FLAGS:-} -o "$out" || true
    for kind in caught missed timeout unviable; do
        printf '%s %s: %s\n' "$name" "$kind" "$(wc -l <"$out/mutants.out/$kind.txt")"
    done
done
