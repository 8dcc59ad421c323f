"""The checkpoint across agent releases: this agent reads what 0.1.0 wrote, 0.1.0 reads what this
agent writes (a rollback of the DaemonSet), and a newer format is refused, never rewritten.

`tests/upgrade/data/checkpoint-0.1.0.json` is a file as release 0.1.0's agent wrote it (made with
that release's own code: `tests/upgrade/data/write_checkpoint_0_1_0.py`); the rollback side runs
that release's checkpoint code itself, from git, in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.agent.checkpoint import (
    CHECKPOINT_VERSION,
    WRITE_VERSION,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    ClaimRecord,
    PreparedDevice,
    migrate,
)
from gpuslice.agent.prepare import NodePaths, Preparer

REPO = Path(__file__).resolve().parents[2]
FIRST_RELEASE = "4ff7adc9020e534cac8e7a17758cdd38992dd65f"  # 0.1.0, CHANGELOG.md
WRITTEN_BY_0_1_0 = REPO / "tests/upgrade/data/checkpoint-0.1.0.json"


def _claims_as_written(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["claims"]


def test_this_agent_reads_the_checkpoint_release_0_1_0_wrote_with_every_claim(tmp_path: Path) -> None:
    written = _claims_as_written(WRITTEN_BY_0_1_0)
    assert len(written) == 3 and {r["state"] for r in written.values()} == {"Prepared", "PrepareStarted"}
    checkpoint = CheckpointStore(WRITTEN_BY_0_1_0).load()
    assert checkpoint.version == CHECKPOINT_VERSION
    assert {uid: r.model_dump(mode="json") for uid, r in checkpoint.claims.items()} == written


async def test_a_claim_0_1_0_left_half_prepared_is_finished_from_its_record_alone(tmp_path: Path) -> None:
    paths = NodePaths(tmp_path / "state", tmp_path / "run", tmp_path / "cdi", Path("/opt/gs/libgpuslice.so"))
    paths.state_dir.mkdir(parents=True)
    (paths.state_dir / "checkpoint.json").write_bytes(WRITTEN_BY_0_1_0.read_bytes())
    written = _claims_as_written(WRITTEN_BY_0_1_0)
    [(uid, half)] = [(u, r) for u, r in written.items() if r["state"] != "Prepared"]

    async def no_api(*_: Any) -> Any:
        raise AssertionError("a recorded claim is finished without asking the API server")

    preparer = Preparer("gpu-node-1", paths, no_api, no_api)
    devices = await preparer.prepare(half["namespace"], half["name"], uid)
    assert [d.model_dump(mode="json") for d in devices] == half["devices"]
    assert paths.cdi_spec(uid).exists()
    after = _claims_as_written(paths.state_dir / "checkpoint.json")
    assert after[uid]["state"] == "Prepared" and set(after) == set(_claims_as_written(WRITTEN_BY_0_1_0))


@pytest.fixture(scope="module")
def release_0_1_0_reads(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], dict[str, Any]]:
    """Load a checkpoint file with release 0.1.0's agent code; its claims as that agent holds them."""
    root = tmp_path_factory.mktemp("gpuslice-0.1.0")
    proc = subprocess.run(
        ["git", "-C", str(REPO), "archive", FIRST_RELEASE, "operator"], capture_output=True, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"commit {FIRST_RELEASE} (release 0.1.0) is not in this clone: fetch the full history "
            f"(git fetch --unshallow) ({proc.stderr.decode().strip()})"
        )
    with tarfile.open(fileobj=BytesIO(proc.stdout)) as tar:
        tar.extractall(root, filter="data")
    program = (
        "import json, sys, gpuslice\n"
        "assert gpuslice.__version__ == '0.1.0', gpuslice.__file__\n"
        "from gpuslice.agent.checkpoint import CheckpointStore\n"
        "c = CheckpointStore(__import__('pathlib').Path(sys.argv[1])).load()\n"
        "print(json.dumps({u: r.model_dump(mode='json') for u, r in c.claims.items()}))\n"
    )

    def read(path: Path) -> dict[str, Any]:
        env = {**os.environ, "PYTHONPATH": str(root / "operator")}
        out = subprocess.run(
            [sys.executable, "-c", program, str(path)], capture_output=True, text=True, env=env, check=False
        )
        assert out.returncode == 0, f"release 0.1.0's agent refuses what this agent wrote:\n{out.stderr}"
        result: dict[str, Any] = json.loads(out.stdout)
        return result

    return read


def test_what_this_agent_writes_release_0_1_0_reads_with_every_claim(
    tmp_path: Path, release_0_1_0_reads: Callable[[Path], dict[str, Any]]
) -> None:
    """A rollback of the DaemonSet: the previous release's agent starts on this agent's checkpoint."""
    store = CheckpointStore(tmp_path / "checkpoint.json")
    checkpoint = CheckpointStore(WRITTEN_BY_0_1_0).load()
    store.save(checkpoint)
    assert json.loads(store.path.read_text())["version"] == WRITE_VERSION
    assert release_0_1_0_reads(store.path) == _claims_as_written(WRITTEN_BY_0_1_0)


def test_a_newer_agents_checkpoint_is_refused_naming_both_versions_and_left_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    newer = json.loads(WRITTEN_BY_0_1_0.read_text()) | {"version": CHECKPOINT_VERSION + 1, "more": {"x": 1}}
    path.write_text(json.dumps(newer))
    before = path.read_bytes()
    with pytest.raises(CheckpointError) as refused:
        CheckpointStore(path).load()
    message = str(refused.value)
    assert f"has version {CHECKPOINT_VERSION + 1}" in message
    assert f"versions 1 to {CHECKPOINT_VERSION}" in message
    assert "written by a newer agent" in message and "roll the DaemonSet forward" in message
    assert path.read_bytes() == before


def test_migrations_run_in_order_from_any_older_version_and_refuse_a_gap() -> None:
    """The chain itself, on formats made up for it: each step sees the previous step's output."""
    steps: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
        1: lambda d: {**d, "version": 2, "claims": {u: {**r, "node": "n"} for u, r in d["claims"].items()}},
        2: lambda d: {**d, "version": 3, "trail": [*d.get("trail", []), "2->3"]},
    }
    v1 = {"version": 1, "claims": {"a": {"uid": "a"}}}
    assert migrate(v1, to=3, migrations=steps) == {"version": 3, "claims": {"a": {"uid": "a", "node": "n"}},
                                                   "trail": ["2->3"]}  # fmt: skip
    assert v1 == {"version": 1, "claims": {"a": {"uid": "a"}}}, "the document read is not changed"
    assert migrate({"version": 2, "claims": {}}, to=3, migrations=steps)["trail"] == ["2->3"]
    with pytest.raises(CheckpointError, match="version 1, which no migration"):
        migrate(v1, to=3, migrations={2: steps[2]})
    with pytest.raises(CheckpointError, match="wrote version 4"):
        migrate(v1, to=2, migrations={1: lambda d: {**d, "version": 4}})


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)
_device = st.builds(
    PreparedDevice,
    request=_text,
    pool=_text,
    device=_text,
    gpu_uuid=_text,
    memory_bytes=st.integers(0, 1 << 40),
    compute_share=st.integers(1, 100),
    cdi_device_ids=st.lists(_text, max_size=3),
)
_record = st.builds(
    ClaimRecord,
    uid=_text,
    namespace=_text,
    name=_text,
    state=st.sampled_from(["PrepareStarted", "Prepared"]),
    devices=st.lists(_device, max_size=2),
    ahead=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_record, max_size=6, unique_by=lambda r: r.uid))
def test_every_claim_survives_a_write_and_a_read(
    records: list[ClaimRecord],
) -> None:
    checkpoint = Checkpoint(claims={r.uid: r for r in records})
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(Path(tmp) / "checkpoint.json")
        store.save(checkpoint)
        assert store.load().claims == checkpoint.claims
        written = json.loads(store.path.read_text())
    assert written["version"] == WRITE_VERSION
    assert Checkpoint.model_validate(migrate(written)).claims == checkpoint.claims


def test_a_burst_slice_keeps_its_flag_and_others_keep_the_older_document() -> None:
    from gpuslice.agent.checkpoint import PreparedDevice

    fields = dict(request="r", pool="n", device="d", gpu_uuid="GPU-1", memory_bytes=1, compute_share=25)
    plain = PreparedDevice(**fields, cdi_device_ids=[])
    burst = PreparedDevice(**fields, cdi_device_ids=[], compute_burst=True)
    assert "compute_burst" not in plain.model_dump(mode="json")
    assert PreparedDevice.model_validate(burst.model_dump(mode="json")).compute_burst is True
