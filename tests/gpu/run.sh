#!/usr/bin/env bash
# Real-GPU check of libgpuslice.so: builds the shim, runs driver-API programs (PTX loaded with
# cuModuleLoadData, so no nvcc) under an 8 GiB / 25 % slice and prints the OOM boundary, the NVML
# memory total, the achieved compute share against the target and the launch-overhead ratio; then the
# compatibility matrix of real CUDA software (tests/shim/test_matrix_*.py) on the real driver.
#
# Needs: an NVIDIA driver (libcuda.so.1, libnvidia-ml.so.1), gcc, make, python3. Headers: carry
# shim/build/include from a machine that built the shim, or let `make -C shim headers` fetch them from
# PyPI, or have cuda.h/nvml.h under /usr/local/cuda*/include.
#   tests/gpu/run.sh [GPU_INDEX]           exit status: number of failed checks
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
shim_dir=$repo/shim
build=$shim_dir/build
gpu=${1:-0}
limit=$((8 << 30))
share=25
work=$(mktemp -d /tmp/gpuslice-gpu.XXXXXX)
trap 'rm -rf "$work"' EXIT
failed=0
passed=0
not_run=()
say() { printf '%s\n' "$*"; }
result() { # result NAME OK(0/1) DETAIL
    if [[ $2 == 0 ]]; then passed=$((passed + 1)); say "PASS $1: $3"; else failed=$((failed + 1)); say "FAIL $1: $3"; fi
}

say "== gpuslice real-GPU check ($(date -u +%FT%TZ), $(uname -n))"
unset LD_PRELOAD GPUSLICE_FAKE_GPU_CONFIG
# Never pick up the test double: only the system's libcuda.so.1 may be loaded here.
export LD_LIBRARY_PATH=$(tr ':' '\n' <<<"${LD_LIBRARY_PATH:-}" | grep -v "shim/build" | paste -sd: -)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

# --- build -------------------------------------------------------------------------------------------
if [[ ! -f $build/include/.stamp ]]; then
    if ! make -C "$shim_dir" headers >"$work/headers.log" 2>&1; then
        for d in /usr/local/cuda/include /usr/local/cuda-*/include /usr/include; do
            if [[ -f $d/cuda.h && -f $d/nvml.h ]]; then
                mkdir -p "$build/include" && cp "$d/cuda.h" "$d/nvml.h" "$build/include/" && touch "$build/include/.stamp"
                say "headers: from $d (PyPI not reachable)"
                break
            fi
        done
    fi
fi
if ! make -C "$shim_dir" all >"$work/build.log" 2>&1; then
    say "FAIL build: make -C shim all"
    tail -30 "$work/build.log"
    exit 1
fi
probe=$build/tests/cuda_probe
say "build: ok ($(ldd "$probe" | awk '/libcuda.so.1/ {print $3}'))"

# --- MIG: only on an A100/H100 whose MIG mode is already on; this script never changes it ---------------
# A card in MIG mode sells only Hardware products (its instances, kept apart by the driver), so the
# shim's checks on the whole card below do not apply to it. tests/gpu/mig_check.py runs the agent's
# own code on the real driver: profiles against the operator's tables, the capability minors of a MIG
# claim's CDI spec against the driver's, CUDA inside the existing instances; it makes (and removes) an
# instance only with GPUSLICE_GPU_MIG_CREATE=1.
mig_state=$(nvidia-smi -i "$gpu" --query-gpu=name,mig.mode.current --format=csv,noheader 2>/dev/null || true)
mig_name=${mig_state%,*}
mig_mode=${mig_state##*, }
python=$repo/.venv/bin/python
[[ -x $python ]] || python=python3
if [[ $mig_mode != Enabled ]]; then
    say "SKIP MIG: GPU $gpu ${mig_name:-?} has MIG mode '${mig_mode:-unknown}' (checked only when it is already Enabled; this script never turns it on)"
elif [[ $mig_name != *A100* && $mig_name != *H100* ]]; then
    say "SKIP MIG: GPU $gpu is a $mig_name in MIG mode; the MIG checks are for the A100/H100 models gpuslice sells"
else
    PYTHONPATH=$repo/operator${PYTHONPATH:+:$PYTHONPATH} "$python" "$repo/tests/gpu/mig_check.py" "$gpu" "$probe" >"$work/mig" 2>&1
    while IFS= read -r line; do
        case $line in
            "PASS "*) passed=$((passed + 1)); say "$line" ;;
            "FAIL "*) failed=$((failed + 1)); say "$line" ;;
            "NOT RUN "*) not_run+=("${line#NOT RUN }") ;;
            *) say "    $line" ;;
        esac
    done <"$work/mig"
    for what in "the shim's checks on the whole card (OOM boundary, allocation paths, NVML totals, compute share, matrix, launch overhead): GPU $gpu is in MIG mode, where gpuslice sells only MIG instances"; do
        not_run+=("$what")
    done
    for what in "${not_run[@]}"; do say "NOT RUN $what"; done
    say "$passed passed, $failed failed, ${#not_run[@]} not run"
    exit "$failed"
fi

# --- the card, without the shim -----------------------------------------------------------------------
if ! "$probe" info >"$work/info.raw" 2>&1; then
    say "FAIL cuda_probe info without shim (no usable NVIDIA driver or GPU here?):"
    sed 's/^/    /' "$work/info.raw"
    for what in "OOM boundary, allocation paths, dlsym/cuGetProcAddress, VMM, context teardown, fork, IPC" \
        "nvidia-smi and NVML totals under the shim" "compute share" \
        "compatibility matrix (libcudart 12.9 and 13.0, CuPy 14, nvitop, cuda-bindings 12.9, numba-cuda 0.30, JAX 0.10.2, PyTorch 2.9.1; alone and under 8 GiB)" \
        "launch overhead against the real driver"; do
        say "NOT RUN $what"
    done
    exit 1
fi
if [[ $gpu != 0 ]]; then export CUDA_VISIBLE_DEVICES=$gpu; "$probe" info >"$work/info.raw" 2>&1; fi
uuid=$(sed -n 's/^uuid=//p' "$work/info.raw")
physical=$(sed -n 's/^total_mem=//p' "$work/info.raw")
say "gpu: $(sed -n 's/^name=//p' "$work/info.raw"), $uuid, physical total $physical bytes"

mkdir -p "$work/usage"
conf=$work/slice.conf
write_conf() {
    printf 'version=1\nmemory_bytes=%s\ncompute_share=%s\ngpu_uuid=%s\nusage_dir=%s\n' "$1" "$2" "$uuid" "$work/usage" >"$conf"
}
write_conf "$limit" "$share"
"$shim_dir/tests/patch_shim.sh" "$build/libgpuslice.so" "$conf" "$work/libgpuslice.so"
under() { LD_PRELOAD="$work/libgpuslice.so" "$@"; }

# --- memory: OOM boundary and reporting ---------------------------------------------------------------
under "$probe" boundary $((2 * limit)) >"$work/boundary" 2>&1
largest=$(sed -n 's/^largest_alloc=//p' "$work/boundary")
plus=$(sed -n 's/^largest_plus_one_rc=//p' "$work/boundary")
result "OOM boundary" "$([[ $largest == "$limit" && $plus == 2 ]] && echo 0 || echo 1)" \
    "largest single cuMemAlloc $largest bytes (slice $limit), one byte more -> rc $plus"
under "$probe" limit "$limit" >"$work/limit" 2>&1
result "limit scenario" $? "$(tail -1 "$work/limit")"
under "$probe" paths "$limit" >"$work/paths" 2>&1
result "allocation paths" $? "$(grep -c '^path ' "$work/paths") paths; $(tail -1 "$work/paths")"
under "$build/tests/dl_probe" "$limit" >"$work/dl" 2>&1
result "dlsym / cuGetProcAddress" $? "$(tail -1 "$work/dl")"
# --- paths real workloads take: VMM, context teardown, fork, IPC within the slice -------
under "$probe" vmm "$limit" >"$work/vmm" 2>&1
result "VMM charged until the last unmap" $? "$(tail -1 "$work/vmm")"
under "$probe" ctx-teardown "$limit" >"$work/ctx" 2>&1
result "context teardown credits its allocations" $? "$(tail -1 "$work/ctx")"
six=$((limit / 4 * 3))
fq=$(under "$probe" fork-query "$six" 2>&1 | sed -n 's/^rc=//p')
result "fork: child's NVML query keeps the parent charged" "$([[ $fq == 2 ]] && echo 0 || echo 1)" \
    "second 6 GiB after the child's query -> rc $fq (expected 2)"
mkfifo "$work/fork.in"
under "$probe" fork-hold "$six" <"$work/fork.in" >"$work/fork.out" 2>&1 &
forker=$!
exec 8>"$work/fork.in"
for _ in $(seq 200); do grep -q "held rc=0" "$work/fork.out" && break; sleep 0.05; done
kill -9 "$forker"; wait "$forker" 2>/dev/null
fo=$(under "$probe" alloc "$six" | sed -n 's/^rc=//p')
exec 8>&-
result "fork: orphaned child keeps nothing charged" "$([[ $fo == 0 ]] && echo 0 || echo 1)" "6 GiB after the parent's SIGKILL -> rc $fo"
mkfifo "$work/ipc.in"
under "$probe" ipc-export $((limit / 2)) <"$work/ipc.in" >"$work/ipc.out" 2>&1 &
exporter=$!
exec 7>"$work/ipc.in"
for _ in $(seq 200); do grep -q handle= "$work/ipc.out" && break; sleep 0.05; done
ipc=$(under "$probe" ipc-open "$(sed -n 's/^handle=//p' "$work/ipc.out")" 2>&1)
exec 7>&-; wait "$exporter"
ipc_after=$(sed -n 's/^free_after=//p' <<<"$ipc")
result "IPC within the slice charged once" "$([[ $ipc_after == $((limit / 2)) ]] && echo 0 || echo 1)" \
    "free after opening the slice's own 4 GiB: $ipc_after (expected $((limit / 2)))"
under "$probe" info >"$work/info.shim" 2>&1
say "cuMemGetInfo total under the shim: $(sed -n 's/^meminfo_total=//p' "$work/info.shim") bytes"
if command -v nvidia-smi >/dev/null; then
    smi=$(under nvidia-smi -i "$gpu" --query-gpu=name,memory.total --format=csv,noheader 2>&1)
    result "nvidia-smi memory.total" "$([[ $smi == *"8192 MiB"* ]] && echo 0 || echo 1)" "$smi (expected 8192 MiB)"
fi
if python3 -c "import pynvml" 2>/dev/null; then
    nv=$(under python3 -c "
import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByUUID('$uuid')
print(pynvml.nvmlDeviceGetMemoryInfo(h).total, pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).total)")
    result "NVML memory total (pynvml v1 v2)" "$([[ $nv == "$limit $limit" ]] && echo 0 || echo 1)" "$nv (expected $limit $limit)"
fi
write_conf unlimited 100
nolimit=$(under "$probe" info | sed -n 's/^total_mem=//p')
result "no limit reports the card" "$([[ $nolimit == "$physical" ]] && echo 0 || echo 1)" "$nolimit bytes"

# --- compute share ------------------------------------------------------------------------------------
write_conf "$limit" 100
base=$(under "$probe" launch 6 2000 kernel | sed -n 's/^busy_fraction=//p')
write_conf "$limit" "$share"
got=$(under "$probe" launch 12 2000 kernel | sed -n 's/^busy_fraction=//p')
gotg=$(under "$probe" launch 8 2000 graph | sed -n 's/^busy_fraction=//p')
ok=$(awk -v g="$got" -v s="$share" 'BEGIN { print (g >= s / 100 * 0.6 && g <= s / 100 * 1.4) ? 0 : 1 }')
result "compute share" "$ok" "target $share %, achieved $(awk -v g="$got" 'BEGIN{printf "%.1f", g*100}') % \
(cuLaunchKernel), $(awk -v g="$gotg" 'BEGIN{printf "%.1f", g*100}') % (cuGraphLaunch); unthrottled $(awk -v g="$base" 'BEGIN{printf "%.1f", g*100}') %"
if command -v unshare >/dev/null && unshare --pid --fork --mount-proc true 2>/dev/null; then
    # Inside a PID namespace the shim cannot match NVML's host PIDs; without the agent's utilization
    # file (written by the node agent from host PIDs) this shows the unthrottled rate, with it the share.
    ns=$(under unshare --pid --fork --mount-proc "$probe" launch 8 2000 kernel | sed -n 's/^busy_fraction=//p')
    say "in a PID namespace without the agent's figure: $(awk -v g="$ns" 'BEGIN{printf "%.1f", g*100}') % (informational)"
fi
python3 - "$work/usage" <<'PY' 2>/dev/null || true
import struct, sys
d = open(sys.argv[1] + "/usage.bin", "rb").read(96)
f = struct.unpack_from("<8sIIIIQII6Q", d)
print(f"usage region: refused={f[8]} throttled={f[9] / 1e9:.1f}s delay={f[12] / 1e3:.0f}us lock_recoveries={f[13]}")
PY

# --- real CUDA software: the compatibility matrix (tests/shim/test_matrix_*.py) on this GPU ------------
# The same tests the suite runs on the driver double, here on the real driver: NVIDIA's runtime 12.9
# and 13.0, CuPy 14, NVIDIA's driver bindings 12.9, numba-cuda 0.30, JAX 0.10.2 and PyTorch 2.9.1
# from their PyPI wheels, alone and under an 8 GiB slice. Wheels come from
# ${XDG_CACHE_HOME:-~/.cache}/gpuslice/wheels (fetched from PyPI when reachable; carry that folder to
# a machine without network). Whatever cannot run is named, never counted as passed.
py=""
for cand in "$repo/.venv/bin/python" /work/main/.venv/bin/python python3; do
    if command -v "$cand" >/dev/null && "$cand" -c "import pytest, pynvml" 2>/dev/null; then py=$cand; break; fi
done
not_run=()
if [[ -z $py ]]; then
    not_run+=("compatibility matrix: no Python with pytest and pynvml (make a venv: pip install -e '.[dev]' devtools)")
else
    export PYTHONPATH="$repo/operator:$repo/devtools${PYTHONPATH:+:$PYTHONPATH}"
    matrix=(tests/shim/test_matrix_cudart.py tests/shim/test_matrix_cupy.py tests/shim/test_matrix_nvml_readers.py
        tests/shim/test_matrix_cuda_bindings.py tests/shim/test_matrix_numba.py)
    if "$py" -c "
import sys; sys.path.insert(0, '$repo/tests')
from shim.matrix import JAX; from gpuslice_dev.wheels import ensure_unpacked
for name, version in JAX: ensure_unpacked(name, version)" >"$work/jax-wheels.log" 2>&1; then
        matrix+=(tests/shim/test_matrix_jax.py)
    else
        not_run+=("JAX matrix: its wheels are not cached and PyPI is not reachable ($(tail -1 "$work/jax-wheels.log"))")
    fi
    if "$py" -c "
import sys; sys.path.insert(0, '$repo/tests')
from shim.matrix import TORCH; from gpuslice_dev.wheels import ensure_unpacked
for name, version in TORCH: ensure_unpacked(name, version)" >"$work/torch-wheels.log" 2>&1; then
        matrix+=(tests/shim/test_matrix_torch.py)
    else
        not_run+=("PyTorch matrix: its wheels are not cached and PyPI is not reachable ($(tail -1 "$work/torch-wheels.log"))")
    fi
    (cd "$repo" && GPUSLICE_MATRIX_REAL_GPU=1 timeout 1800 "$py" -m pytest -q -rsx -p no:cacheprovider \
        "${matrix[@]}" >"$work/matrix.log" 2>&1)
    rc=$?
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL)|passed|failed" "$work/matrix.log" | sed 's/^/    /'
    summary=$(tail -1 "$work/matrix.log")
    if grep -q "ERROR .*WheelError\|WheelError" "$work/matrix.log"; then
        not_run+=("part of the matrix: a client's wheel could not be fetched (see WheelError above)")
    fi
    result "compatibility matrix on the real driver" "$([[ $rc == 0 ]] && echo 0 || echo 1)" "$summary"
    [[ $rc != 0 ]] && grep -E "^E " "$work/matrix.log" | head -40 | sed 's/^/    /'
fi

# --- launch overhead ----------------------------------------------------------------------------------
write_conf "$limit" 100
say "launch / alloc overhead against the real driver (best of 7):"
GPUSLICE_BENCH_REAL_DRIVER=1 GPUSLICE_BENCH_GPU_UUID=$uuid "$shim_dir/tests/bench.sh" "$build" 20000 | tee "$work/bench"
ratio=$(awk '$1 == "cuLaunchKernel" {print $5}' "$work/bench")
result "launch overhead" "$(awk -v r="$ratio" 'BEGIN { print (r != "" && r < 1.10) ? 0 : 1 }')" "cuLaunchKernel ratio $ratio (shim / driver)"

for what in "${not_run[@]}"; do say "NOT RUN $what"; done
say "$passed passed, $failed failed, ${#not_run[@]} not run"
exit "$failed"
