#!/usr/bin/env bash
# Prints ns per cuLaunchKernel / cuMemAlloc / cuMemFree without and with libgpuslice.so against the
# same driver (the test double unless GPUSLICE_BENCH_REAL_DRIVER=1), best of 7 runs each, and ratios.
# GPUSLICE_BENCH_DRIVERD=1 runs the double with its host daemon (requests instead of shared writes).
#   tests/bench.sh BUILD_DIR [ITERATIONS] [PTX_FILE]
set -euo pipefail
build=${1:?usage: bench.sh BUILD_DIR [ITERATIONS] [PTX_FILE]}
iters=${2:-200000}
ptx=${3:-}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/gpuslice-bench.XXXXXX)
daemon=
trap 'if [[ -n "$daemon" ]]; then kill "$daemon"; wait "$daemon" || true; fi; rm -rf "$work"' EXIT

if [[ "${GPUSLICE_BENCH_REAL_DRIVER:-0}" != 1 ]]; then
    "$here/write_fake_config.sh" "$work/fake.conf" 1
    export GPUSLICE_FAKE_GPU_CONFIG="$work/fake.conf" LD_LIBRARY_PATH="$build/fake${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    uuid=$(sed -n 's/^gpu.0.uuid=//p' "$work/fake.conf")
    if [[ "${GPUSLICE_BENCH_DRIVERD:-0}" == 1 ]]; then
        "$build/fake/gpuslice-fake-driverd" --config "$work/fake.conf" >"$work/driverd.log" 2>&1 &
        daemon=$!
        for _ in $(seq 100); do [[ -S "$work/fake.conf.state/driver.sock" ]] && break; sleep 0.05; done
    fi
else
    uuid=${GPUSLICE_BENCH_GPU_UUID:?set GPUSLICE_BENCH_GPU_UUID to the GPU UUID (nvidia-smi -L)}
fi
mkdir -p "$work/usage"
printf 'version=1\nmemory_bytes=%s\ncompute_share=100\ngpu_uuid=%s\nusage_dir=%s\n' \
    $((8 << 30)) "$uuid" "$work/usage" > "$work/slice.conf"
"$here/patch_shim.sh" "$build/libgpuslice.so" "$work/slice.conf" "$work/libgpuslice.so"

# Runs alternate (driver, driver + shim) so load from other processes hits both alike; best of 7 each.
: >"$work/plain"
: >"$work/shim"
for _ in 1 2 3 4 5 6 7; do
    "$build/shim_bench" "$iters" $ptx >>"$work/plain"
    LD_PRELOAD="$work/libgpuslice.so" "$build/shim_bench" "$iters" $ptx >>"$work/shim"
done
best() {
    awk -F= '/_ns=/ { if (!($1 in m) || $2 < m[$1]) m[$1] = $2 }
        END { printf "%s %s %s\n", m["launch_ns"], m["alloc_ns"], m["free_ns"] }' "$1"
}
read -r l0 a0 f0 < <(best "$work/plain")
read -r l1 a1 f1 < <(best "$work/shim")
awk -v l0="$l0" -v a0="$a0" -v f0="$f0" -v l1="$l1" -v a1="$a1" -v f1="$f1" 'BEGIN {
    printf "%-14s %12s %12s %10s %8s\n", "call", "driver ns", "+shim ns", "added ns", "ratio"
    printf "%-14s %12.1f %12.1f %10.1f %8.3f\n", "cuLaunchKernel", l0, l1, l1 - l0, l1 / l0
    printf "%-14s %12.1f %12.1f %10.1f %8.3f\n", "cuMemAlloc", a0, a1, a1 - a0, a1 / a0
    printf "%-14s %12.1f %12.1f %10.1f %8.3f\n", "cuMemFree", f0, f1, f1 - f0, f1 / f0
}'
