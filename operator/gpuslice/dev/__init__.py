"""Development tooling: the local devcluster, the demo, the simulated-agent launcher and the Python
side of the NVIDIA driver test double.

Nothing in the product (`api`, `domain`, `operator`, `agent`, `shim`) imports this package; only the
console script's entry point (`gpuslice.cli`) names its subcommands, and skips them when it is not
installed. tests/test_layers.py enforces both.
"""
