"""Graph building beyond memory nodes on the double, alone and under a slice: the generic node API,
edges and roots, clones that replay their copies, child graphs, capture into an existing graph and a
kernel node's new parameters in an executable graph, each answered as the driver does (not
CUDA_ERROR_NOT_SUPPORTED) and each launch taking the time of the kernels the graph holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shim.matrix import REAL_GPU
from shim.shim_helpers import GIB, env_of, values

pytestmark = pytest.mark.skipif(REAL_GPU, reason="times the double's kernels; a real GPU times its own")
CLIENT = Path(__file__).parent / "clients" / "graph_client.py"


@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_graph_nodes_edges_clones_children_capture_and_updates(make_slice, memory):
    s = make_slice(memory_bytes=memory)
    env = {**env_of(s, shim=memory is not None), "GPUSLICE_FAKE_KERNEL_TIME": "fast=2ms,slow=150ms"}
    proc = subprocess.run([sys.executable, str(CLIENT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    ok = [
        "init", "ctx", "module", "stream", "alloc", "add_node_kernel", "add_node_empty", "add_dependency",
        "instantiate", "fast_rc", "exec_set_params", "slow_rc", "fresh_rc", "memset_node", "clone",
        "clone_launch", "child_node", "child_get_graph", "capture_to_graph", "end_capture",
        "parent_instantiate", "parent_rc",
    ]  # fmt: skip
    assert {k: v[k] for k in ok} == dict.fromkeys(ok, "0"), v
    assert (v["roots_before_edge"], v["roots_after_edge"], v["root_is_the_kernel"]) == ("2", "1", "1"), v
    assert v["edge_to_a_stranger"] == "1", v  # CUDA_ERROR_INVALID_VALUE: not a node of the graph
    assert float(v["fast_ms"]) < 100 <= float(v["slow_ms"]), v  # the update took effect
    assert float(v["fresh_ms"]) < 100, v  # ... in the executable only
    assert v["exec_set_params_foreign_node"] == "1", v  # an empty node is no kernel node
    assert v["clone_filled"] == "5", v
    assert v["child_is_a_copy"] == "1", v
    assert v["capture_gave_the_same_graph"] == "1", v
    assert v["parent_nodes"] == "3", v  # the child, the empty node, the captured fill
    assert float(v["parent_ms"]) >= 140, v  # the child graph's slow kernel
    assert v["captured_fill"] == "9", v
