"""MIG checks of tests/gpu/run.sh on a real card already in MIG mode, through the agent's own code and
the real driver: never turns MIG on or off, never resets the card.

Read-only by default: the profiles the driver reports against the operator's tables (what
isolation.memory maps to), the capability minors the agent puts in a MIG claim's CDI spec against
the driver's own /proc/driver/nvidia/capabilities files, and CUDA inside each MIG instance that
already exists (its memory is the instance's; past it the driver itself refuses). With
GPUSLICE_GPU_MIG_CREATE=1 it also makes one instance of the smallest profile at a free placement as
the agent does at prepare, checks it the same way and destroys it (an instance it made is always
destroyed on the way out).

    python tests/gpu/mig_check.py GPU_INDEX PROBE      one line per check: PASS/FAIL/NOT RUN name: detail
"""

from __future__ import annotations

import os
import subprocess
import sys


def say(kind: str, name: str, detail: str) -> None:
    print(f"{kind} {name}: {detail}", flush=True)


def probe_lines(probe: str, mig_uuid: str, *args: str) -> dict[str, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": mig_uuid}
    env.pop("LD_PRELOAD", None)  # no shim: the driver keeps the instance's memory
    out = subprocess.run([probe, *args], env=env, capture_output=True, text=True, timeout=300).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def driver_cap_minor(gpu_minor: int, cap: str) -> int | None:
    """The minor the driver itself shows for a capability (what k8s-dra-driver-gpu reads)."""
    from gpuslice.agent import mig

    gpu, rest = cap.split("/", 1)
    path = mig.proc_root() / "driver" / "nvidia" / "capabilities" / gpu / "mig" / rest
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "DeviceFileMinor":
                return int(value.strip())
    except (OSError, ValueError):
        return None
    return None


def check_instance(probe: str, instance: object, gpu_minor: int, minors: dict[str, int], label: str) -> None:
    from gpuslice.agent import cdi

    gi, ci, uuid = instance.gpu_instance_id, instance.compute_instance_id, instance.uuid  # type: ignore[attr-defined]
    caps = [cdi.gi_cap(gpu_minor, gi), cdi.ci_cap(gpu_minor, gi, ci)]
    ours = [minors.get(cap) for cap in caps]
    drivers = [driver_cap_minor(gpu_minor, cap) for cap in caps]
    ok = None not in ours and ours == drivers
    say("PASS" if ok else "FAIL", f"{label} capability minors",
        f"{uuid} gi {gi} ci {ci}: mig-minors {ours}, the driver's capability files {drivers}")  # fmt: skip
    info = probe_lines(probe, uuid, "info")
    total = int(info.get("total_mem") or 0)
    if not total:
        say("FAIL", f"{label} CUDA in the instance", f"cuda_probe info, CUDA_VISIBLE_DEVICES={uuid}: {info}")
        return
    got = probe_lines(probe, uuid, "boundary", str(2 * total))
    largest, rc = int(got.get("largest_alloc") or 0), got.get("largest_plus_one_rc")
    ok = 0 < largest <= total and rc == "2"
    say("PASS" if ok else "FAIL", f"{label} memory kept by the driver",
        f"{uuid}: cuDeviceTotalMem {total} bytes, largest cuMemAlloc {largest}, one byte more -> rc {rc} "
        "(no shim)")  # fmt: skip


def main() -> int:
    gpu_index, probe = int(sys.argv[1]), sys.argv[2]
    try:
        from gpuslice.agent import cdi, gpus, mig, nvml
        from gpuslice.domain.mig import PROFILE_TABLES
    except ImportError as exc:
        say("NOT RUN", "MIG checks", f"the agent's code does not import here ({exc}); carry .venv")
        return 0
    cards = {g.index: g for g in gpus.discover()}
    card = cards[gpu_index]
    if card.mig_profiles is None:
        say("NOT RUN", "MIG checks", f"NVML says GPU {gpu_index} is not in MIG mode")
        return 0
    table = PROFILE_TABLES.get(card.product_name)
    reported = sorted((p.name, p.slices, p.memory_mib) for p in card.mig_profiles)
    if table is None:
        say("NOT RUN", "MIG profile table", f"the operator has no table for {card.product_name}: {reported}")
    else:
        want = sorted((p.name, p.compute_slices, p.memory_mib) for p in table)
        differs = "" if reported == want else f", table {want}"
        say("PASS" if reported == want else "FAIL", "MIG profiles against the operator's table",
            f"{card.product_name}: driver {reported}{differs}")  # fmt: skip
    proc = mig.proc_root()
    try:
        minors = cdi.parse_mig_minors((proc / "driver/nvidia-caps/mig-minors").read_text())
        major = cdi.char_major((proc / "devices").read_text(), cdi.MIG_CAPS_DEVICE)
    except OSError as exc:
        say("FAIL", "nvidia-caps", f"reading {proc}: {exc}")
        return 0
    say("PASS" if minors and major else "FAIL", "nvidia-caps",
        f"{len(minors)} capabilities in mig-minors, nvidia-caps major {major}")  # fmt: skip
    with nvml.session():
        existing = nvml.mig_instances(card.uuid)
    if not existing:
        say("NOT RUN", "CUDA in an existing MIG instance", f"GPU {gpu_index} has no MIG instance")
    for k, instance in enumerate(existing):
        check_instance(probe, instance, card.minor_number, minors, f"existing instance {k}")
    if os.environ.get("GPUSLICE_GPU_MIG_CREATE") != "1":
        say("NOT RUN", "dynamic MIG (an instance made and destroyed as at prepare)",
            "GPUSLICE_GPU_MIG_CREATE=1 lets it make one instance on the card and remove it")  # fmt: skip
        return 0
    smallest = min((p for p in card.mig_profiles if not p.media), key=lambda p: (p.memory_mib, p.slices))
    made = None
    with nvml.session():
        taken = [(i.start, i.size) for i in nvml.mig_instances(card.uuid)]
        for start, size in smallest.placements:
            if all(start + size <= s or s + n <= start for s, n in taken):
                try:
                    made = nvml.mig_create(card.uuid, smallest, start)
                except nvml.MigError as exc:
                    say("FAIL", "dynamic MIG create", f"{smallest.name} at {start}: {exc}")
                    return 0
                break
    if made is None:
        say("NOT RUN", "dynamic MIG", f"no free placement of {smallest.name} on GPU {gpu_index}")
        return 0
    try:
        say("PASS", "dynamic MIG create", f"{smallest.name} at memory slice {made.start}: {made.uuid}")
        check_instance(probe, made, card.minor_number, minors, "made instance")
    finally:
        with nvml.session():
            gone = nvml.mig_destroy(card.uuid, made.uuid)
            left = [i.uuid for i in nvml.mig_instances(card.uuid) if i.uuid == made.uuid]
        say("PASS" if gone and not left else "FAIL", "dynamic MIG destroy", f"{made.uuid} removed: {gone}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
