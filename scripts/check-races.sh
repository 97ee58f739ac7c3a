#!/usr/bin/env bash
# ThreadSanitizer over the GPU kernels' CPU emulation (crates/zcuda-emu built
# with ZCUDA_EMU_TSAN=1): each CUDA thread of a block is a TSan fiber, and
# what orders a block's threads on a GPU (__syncthreads, a warp's exchanges,
# a block's start and end) is told to TSan (cpp/emu_fiber.h), so that two
# threads touching the same memory, one writing, with no barrier between are
# reported whatever order the emulation ran them in. First the detector
# itself: the emulation's two probe kernels, each with such a race, must be
# reported (and the run fail); then every kernel test runs, and any report
# fails it. About 2 minutes on 2 cores, the build included; CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
supp=$PWD/crates/zcuda-emu/tsan.supp
export ZCUDA_EMU_TSAN=1 ZRUN_REQUIRE_EMULATOR=1 ZCUDA_EMU_WARP_ORDER=forward
artifacts=$(mktemp)
trap 'rm -f "$artifacts" "$artifacts.probe"' EXIT
# The whole workspace's test build, so that every other crate is the one the
# README's tests built (`-p zcuda-emu` alone resolves features afresh and
# rebuilt some 200 crates, 3 minutes of CI); only zcuda-emu is built anew.
cargo test --release --workspace --no-run --message-format=json-render-diagnostics > "$artifacts"
exe=$(python3 scripts/test_exe.py zcuda-emu zcuda_emu "$artifacts")
cd crates/zcuda-emu
echo "== TSan sees the probe kernels' races"
rc=0
TSAN_OPTIONS="suppressions=$supp" "$exe" --exact tests::each_warp_order_shows_the_race_the_other_hides \
  > "$artifacts.probe" 2>&1 || rc=$?
for probe in broadcast_unsynced gather_unsynced; do
  if [ "$rc" != 66 ] || ! grep -q "data race.* in probe::$probe" "$artifacts.probe"; then
    cat "$artifacts.probe"
    echo "check-races: TSan did not report probe::$probe's race (exit $rc)" >&2
    exit 1
  fi
done
echo "both reported"
echo "== every kernel test under TSan, no race reported (a process each, two at a time)"
# A process a test: in one process the harness's threads slow each other
# under TSan (measured on 2 cores: the 24 tests in 194 s on two threads,
# 151 s on one; a process each, 130 s of CPU, so about 70 s two at a time).
tests=$("$exe" --list --format terse | sed -n 's/: test$//p' \
  | grep -v -x -e tests::each_warp_order_shows_the_race_the_other_hides \
    -e tests::every_kernel_test_passes_with_the_last_warp_ahead)
[ -n "$tests" ] || { echo "check-races: no kernel test listed" >&2; exit 1; }
echo "$(echo "$tests" | wc -l) tests"
export TSAN_OPTIONS="suppressions=$supp"
echo "$tests" | xargs -P 2 -I{} bash -c '
  out=$(mktemp)
  rc=0; "$0" --exact "$1" > "$out" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then echo "ok: $1"; rm -f "$out"; exit 0; fi
  cat "$out"; rm -f "$out"; echo "check-races: $1 failed (exit $rc)" >&2; exit 1' "$exe" {}
