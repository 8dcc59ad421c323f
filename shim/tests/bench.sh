#!/usr/bin/env bash
# Prints ns per cuLaunchKernel / cuMemAlloc / cuMemFree without and with libgpuslice.so against the
# same driver (the test double unless GPUSLICE_BENCH_REAL_DRIVER=1): the median per-round ratio of
# GPUSLICE_BENCH_ROUNDS (31) paired rounds, with its spread.
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

# Paired rounds: each round runs the driver alone and the driver + shim back to back (which goes first
# alternates, so drift and a neighbour's load hit both sides alike) and yields one ratio per call.
# The median ratio over the rounds and its spread (25th-75th percentile, min-max) say whether a goal
# like 1.05x holds in this one run; a best-of-N on each side alone could not tell it from noise.
rounds=${GPUSLICE_BENCH_ROUNDS:-31}
: >"$work/pairs"
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then
        p=$("$build/shim_bench" "$iters" $ptx)
        s=$(LD_PRELOAD="$work/libgpuslice.so" "$build/shim_bench" "$iters" $ptx)
    else
        s=$(LD_PRELOAD="$work/libgpuslice.so" "$build/shim_bench" "$iters" $ptx)
        p=$("$build/shim_bench" "$iters" $ptx)
    fi
    # one line per round: launch alloc free (driver), then the same with the shim
    printf '%s %s\n' "$(awk -F= '/_ns=/ {printf "%s ", $2}' <<<"$p")" "$(awk -F= '/_ns=/ {printf "%s ", $2}' <<<"$s")" >>"$work/pairs"
done
awk -v rounds="$rounds" '
    function sort(a, n,   i, j, t) { for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j > 0 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t } }
    function q(a, n, p,   k) { k = 1 + (n - 1) * p; return a[int(k)] + (k - int(k)) * (a[int(k) + 1] - a[int(k)]) }
    { n++; for (c = 1; c <= 3; c++) { d[c, n] = $c; w[c, n] = $(c + 3); r[c, n] = $(c + 3) / $c } }
    END {
        name[1] = "cuLaunchKernel"; name[2] = "cuMemAlloc"; name[3] = "cuMemFree"
        printf "%d paired rounds (driver alone / driver + shim, order alternating); median of each\n", n
        printf "%-14s %10s %10s %9s %8s %15s %15s\n", "call", "driver ns", "+shim ns", "added ns", "ratio", "ratio p25-p75", "ratio min-max"
        for (c = 1; c <= 3; c++) {
            for (i = 1; i <= n; i++) { x[i] = d[c, i]; y[i] = w[c, i]; z[i] = r[c, i] }
            sort(x, n); sort(y, n); sort(z, n)
            printf "%-14s %10.1f %10.1f %9.1f %8.3f %7.3f-%-7.3f %7.3f-%-7.3f\n", name[c], q(x, n, 0.5), q(y, n, 0.5), q(y, n, 0.5) - q(x, n, 0.5), q(z, n, 0.5), q(z, n, 0.25), q(z, n, 0.75), z[1], z[n]
        }
    }' "$work/pairs"
