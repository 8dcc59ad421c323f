"""The process supervisor every devcluster component runs under: start logged in its own session,
know it by pid and start time (so a recycled pid is never mistaken for it), stop it, probe health.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice import procfs
from gpuslice_dev.devcluster import pki


class DevClusterError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ProcessRecord:
    pid: int
    start_time: int
    log: str
    argv: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        stat = procfs.read_stat(self.pid)
        return stat is not None and stat.start_time == self.start_time and not stat.zombie

    def rss_bytes(self) -> int:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0


def spawn(log: Path, argv: list[str], env: dict[str, str] | None = None) -> ProcessRecord:
    """Start `argv` appending to `log`, in a new session: the component outlives the
    `gpuslice-dev devcluster up` that started it, and a Ctrl-C in that shell."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as fh:
        fh.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    return ProcessRecord(proc.pid, procfs.start_time(proc.pid) or 0, str(log), argv)


def stop(rec: ProcessRecord, grace: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL after `grace` seconds; False when it was not running."""
    if not rec.alive():
        return False
    try:
        os.kill(rec.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not rec.alive() or not procfs.alive(rec.pid):
            _reap(rec.pid)
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(rec.pid, signal.SIGKILL)
    _reap(rec.pid)
    return True


def _reap(pid: int) -> None:
    # Only our own children can be reaped; for processes started by another `up` this is a no-op.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def client_ssl(ca: Path, client: pki.CertPair) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(client.cert), str(client.key))
    return ctx


def insecure_ssl() -> ssl.SSLContext:
    # Controller-manager and scheduler serve health on self-signed certificates they generate.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False
