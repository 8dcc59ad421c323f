"""The driver test double's host-side part (gpuslice-fake-driverd), playing the kernel module.

Processes in their own PID namespace (as in any pod) are listed by NVML under their host PIDs, and
the memory of a process that was SIGKILLed is freed by the daemon, like the real driver does.
"""

from __future__ import annotations

import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from subprocess import PIPE

import pytest

from gpuslice_dev.devcluster.images import probe_binary
from gpuslice_dev.gpusim.simulate import driver_socket, start_fake_driverd
from shim.shim_helpers import GIB, V100, env_of, probe, run, values

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")

LIST_PROCESSES = textwrap.dedent(
    """
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    print("procs=" + ",".join(f"{p.pid}:{p.usedGpuMemory}" for p in procs))
    print(f"used={pynvml.nvmlDeviceGetMemoryInfo(h).used}")
    """
)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.extend(int(p) for p in text)
    return found


def _host_view(s) -> dict[str, str]:
    out = run(s, [sys.executable, "-c", LIST_PROCESSES], shim=False)
    assert out.returncode == 0, out.stderr
    return values(out.stdout)


@pytest.fixture
def driverd(make_slice):
    s = make_slice(memory_bytes=None)
    conf = s.workdir / "fake-gpus.conf"
    proc = start_fake_driverd(conf)
    assert driver_socket(conf).is_socket()
    yield s
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert not driver_socket(conf).exists(), "the daemon removes its socket on exit"


@pytest.mark.parametrize("with_shim", [False, True])
def test_nvml_lists_host_pids_and_a_killed_process_is_freed(driverd, built, with_shim):
    s = driverd
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", str(probe(built)), "hold", str(GIB)],
        env=env_of(s, shim=with_shim),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held rc=0"
        (host_pid,) = _children(holder.pid)
        view = _host_view(s)
        assert view["procs"] == f"{host_pid}:{GIB}", "NVML must report the host PID, not the namespace's"
        assert int(view["used"]) == GIB
        subprocess.run(["kill", "-KILL", str(host_pid)], check=True)
        holder.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _host_view(s)["procs"]:
            time.sleep(0.05)
        view = _host_view(s)
        assert view["procs"] == "" and int(view["used"]) == 0, f"memory of the killed process stays: {view}"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)


def test_a_process_that_ends_normally_is_freed_and_the_double_works_without_the_daemon(make_slice, built):
    s = make_slice(memory_bytes=None)
    conf = s.workdir / "fake-gpus.conf"
    assert (
        values(run(s, [probe(built), "alloc", GIB], shim=False).stdout)["rc"] == "0"
    )  # no daemon: as before
    proc = start_fake_driverd(conf)
    try:
        assert values(run(s, [probe(built), "alloc", GIB], shim=False).stdout)["rc"] == "0"
        assert int(_host_view(s)["used"]) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---------------------------------------------------------------- any uid, and a state no client writes

REQ = struct.Struct("=Iiq")  # fake_req: op, dev (the GPU's place on the node), arg
REP = struct.Struct("=iIQ")  # fake_rep: rc, pad, val
HELLO = struct.Struct("=8siIQ")  # fake_hello: magic, host pid, pad, start time
OP_SLOT, OP_CHARGE, OP_UNCHARGE, OP_CONTEXTS = 1, 2, 3, 4

#: (uid, gid): a usual non-root user, and an arbitrary uid without a passwd entry in group 0 (as
#: OpenShift-style restricted pods run)
UIDS = [(1000, 1000), (1000680000, 0)]


def as_user(uid: int, gid: int, argv: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv]


@pytest.fixture
def shared_slice(built, tmp_path_factory):
    """An 8 GiB slice whose files any uid can reach (pytest's own tmp dirs are root's alone), with
    the double's host daemon serving, as on a node."""
    from gpuslice_dev.gpusim.runner import prepare

    top = Path(tempfile.mkdtemp(prefix="gpuslice-anyuid-"))
    top.chmod(0o755)
    s = prepare(
        memory_bytes=8 * GIB, simulate_gpus=V100, seed="test-node", workdir=top / "slice", built=built
    )
    for p in (s.workdir, s.workdir / "lib"):
        p.chmod(0o755)
    conf = s.workdir / "fake-gpus.conf"
    proc = start_fake_driverd(conf)
    yield s
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    shutil.rmtree(top, ignore_errors=True)


ATTACK = textwrap.dedent(
    """
    import os, socket, struct, sys
    state, sock, dev = sys.argv[1], sys.argv[2], int(sys.argv[3])
    REQ, REP = struct.Struct("=Iiq"), struct.Struct("=iIQ")
    for name in sorted(os.listdir(state)):
        path = os.path.join(state, name)
        if name.endswith(".bin"):
            try:
                open(path, "r+b").write(bytes(64))
                print(f"wrote {name}")
            except PermissionError:
                print(f"refused {name}")
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(sock)
    c.recv(64)  # the hello
    def ask(op, arg, d=dev):
        c.send(REQ.pack(op, d, arg))
        return REP.unpack(c.recv(64))[0]
    print("uncharge", ask(3, 64 << 30))       # give back memory it never held
    print("charge", ask(2, 64 << 30))         # more than the card
    print("contexts", ask(4, 1000))           # contexts by the thousand
    print("device", ask(2, 1, d=7))           # a GPU the node does not have
    c.send(b"garbage")
    print("garbage", REP.unpack(c.recv(64))[0])
    print("negative", ask(2, -(1 << 40)))     # a charge that would shrink the card's use
    """
)


@pytest.mark.parametrize(("uid", "gid"), UIDS)
def test_any_uid_gets_its_slice_and_cannot_change_the_doubles_state(shared_slice, built, uid, gid):
    s = shared_slice
    conf = s.workdir / "fake-gpus.conf"
    state = Path(f"{conf}.state")
    files = {p.name: oct(p.stat().st_mode & 0o777) for p in state.glob("*.bin")}
    assert files == {"gpu0.bin": "0o644", "health.bin": "0o644", "mig.bin": "0o644"}
    assert oct(state.stat().st_mode & 0o777) == "0o755", "only the daemon adds or replaces state files"

    holder = subprocess.Popen(
        as_user(uid, gid, [str(probe(built)), "hold", str(6 * GIB)]),
        env=env_of(s), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stderr is not None
        line = holder.stdout.readline().strip()
        assert line == "held rc=0", f"{line!r}: {holder.stderr.read() if holder.poll() is not None else ''}"
        before = _host_view(s)
        assert before["procs"] == f"{holder.pid}:{6 * GIB}" and int(before["used"]) == 6 * GIB

        attack = subprocess.run(
            as_user(uid, gid, [sys.executable, "-c", ATTACK, str(state), str(driver_socket(conf)), "0"]),
            env=env_of(s, shim=False), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert attack.returncode == 0, attack.stderr
        lines = [line.split(" ", 1) for line in attack.stdout.splitlines()]
        assert [n for k, n in lines if k == "refused"] == sorted(files), "every state file refused"
        said = dict(kv for kv in lines if kv[0] != "refused")
        assert said == {
            "uncharge": "0",  # accepted, and frees nothing: it held nothing
            "charge": "2",  # out of memory
            "contexts": "1",
            "device": "1",
            "garbage": "1",
            "negative": "1",
        }
        assert _host_view(s) == before, "NVML must still tell the truth about the holder"

        # the slice's accounting is shared with processes of other uids: 6 of 8 GiB held, 2 GiB left
        other = (1000680000, 0) if uid == 1000 else (1000, 1000)
        for who, size, rc in ((other, 4 * GIB, "2"), ((0, 0), 4 * GIB, "2"), (other, 2 * GIB, "0")):
            out = subprocess.run(
                as_user(*who, [str(probe(built)), "alloc", str(size)]), env=env_of(s),
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert values(out.stdout).get("rc") == rc, (who, size, out.stdout + out.stderr)
    finally:
        if holder.poll() is None:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(timeout=30)
    assert int(_host_view(s)["used"]) == 0


def test_launches_through_the_daemon_show_in_nvml_under_the_host_pid(shared_slice, built):
    """Kernels of a non-root process in its own PID namespace: utilization is the daemon's merge of
    the process's own busy segment, listed under its host PID."""
    s = shared_slice
    burner = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc",
         *as_user(1000680000, 0, [str(probe_binary(built)), "burn", "3"])],
        env=env_of(s, shim=False), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(1.5)
        (host_pid,) = _children(burner.pid)
        sample = subprocess.run(
            [sys.executable, "-c", UTILIZATION], env=env_of(s, shim=False), capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert sample.returncode == 0, sample.stderr
        view = values(sample.stdout)
        pids = dict(p.split(":") for p in view["procs"].split(",") if p)
        # (how busy depends on how much CPU the burner gets on a loaded machine; that it shows does not)
        assert list(pids) == [str(host_pid)], f"the burner under its host PID {host_pid}: {view}"
        assert 0 < int(pids[str(host_pid)]) <= int(view["gpu"]) <= 100, view
        _, err = burner.communicate(timeout=30)
        assert burner.returncode == 0, err
    finally:
        if burner.poll() is None:
            burner.kill()
            burner.wait(timeout=30)


@pytest.mark.parametrize(("n", "kernel_us"), [(2, 1000), (3, 10000)])
def test_processes_burning_one_card_through_the_daemon_share_it(driverd, built, n, kernel_us):
    """As a GPU time-slices between contexts: n processes launching kernels back to back on one card
    (no slice limiting them) each get about 1/n of it, and together never more than the card, in
    their own measurement and in NVML's. Kernels shorter than the daemon's merges (every 5 ms) are
    where a double that queued a process behind others only once merged would run them side by side."""
    env = env_of(driverd, shim=False)
    # one window for all: each measures its share over its second half, and a burner that set up
    # seconds after another (a loaded machine) would otherwise have the card to itself for part of it
    start_at = time.time() + 3
    argv = [str(probe_binary(built)), "burn", "4", str(kernel_us), f"{start_at:.3f}"]
    burners = [subprocess.Popen(argv, env=env, stdout=PIPE, stderr=PIPE, text=True) for _ in range(n)]
    try:
        time.sleep(max(0.0, start_at + 3 - time.time()))  # NVML's last second within every second half
        sample = subprocess.run(
            [sys.executable, "-c", UTILIZATION], env=env, capture_output=True, text=True, timeout=60
        )
        assert sample.returncode == 0, sample.stderr
        view = values(sample.stdout)
        shares: list[float] = []
        late: list[float] = []
        for b in burners:
            out, err = b.communicate(timeout=60)
            assert b.returncode == 0, err
            lines = out.splitlines()
            shares.extend(float(line.split()[1]) for line in lines if line.startswith("share "))
            late.extend(float(line.split("=")[1]) for line in lines if line.startswith("started late="))
    finally:
        for b in burners:
            if b.poll() is None:
                b.kill()
                b.wait(timeout=30)
    sm = [int(p.split(":")[1]) for p in view["procs"].split(",") if p]
    print(f"{n} burners of {kernel_us} us: shares {shares} (sum {sum(shares):.1f}), NVML {view}")
    assert len(shares) == n and len(sm) == n, (shares, view)
    assert len(late) == n and max(late) < 1.0, f"a burner set up after the common start: {late}"
    # the probes' own figures round each to 0.1 % of their own window: a little over 100 together
    assert sum(shares) <= 105, f"{n} processes used {sum(shares):.1f} % of one card: {shares}"
    assert sum(sm) <= 100 and int(view["gpu"]) <= 100, view
    # the card is shared, not lost: each near its 1/n (a loaded machine delays a burner's next launch)
    fair = 100 / n
    assert all(0.6 * fair <= x <= 1.2 * fair for x in shares), shares
    assert all(0.6 * fair <= x <= 1.2 * fair for x in sm), view


UTILIZATION = textwrap.dedent(
    """
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    print(f"gpu={pynvml.nvmlDeviceGetUtilizationRates(h).gpu}")
    samples = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
    print("procs=" + ",".join(f"{p.pid}:{p.smUtil}" for p in samples))
    """
)


REACH = textwrap.dedent(
    """
    import socket, struct, sys
    REQ, REP = struct.Struct("=Iiq"), struct.Struct("=iIQ")
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(sys.argv[1])
    c.recv(64)
    for dev in (0, 1):
        c.send(REQ.pack(2, dev, 1 << 30))
        print(f"gpu{dev}={REP.unpack(c.recv(64))[0]}")
    """
)


def test_the_daemon_charges_only_gpus_whose_device_node_the_process_has(built, tmp_path):
    """As the real driver: without /dev/nvidia1 a process cannot put memory on GPU 1, even by talking to
    the daemon itself (rc 4), while GPU 0, whose node it has, takes the charge."""
    from gpuslice_dev.gpusim.runner import prepare

    s = prepare(
        memory_bytes=None, simulate_gpus="2x Tesla V100-PCIE-32GB", seed="n", workdir=tmp_path, built=built
    )
    conf = s.workdir / "fake-gpus.conf"
    proc = start_fake_driverd(conf)
    try:
        dev = tmp_path / "dev"
        dev.mkdir()
        (dev / "nvidiactl").touch()
        (dev / "nvidia0").touch()
        script = f"mount --bind {dev} /dev && exec {sys.executable} -c '{REACH}' {driver_socket(conf)}"
        out = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert values(out.stdout) == {"gpu0": "0", "gpu1": "4"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
