"""The shim's Python side in the product: the limits file it reads and the usage region it writes.

The shim itself is C (`shim/` at the repository root); see shim/README.md for its design. Building
it, the driver test double and `gpuslice-dev shim run` are dev tooling (`gpuslice_dev.gpusim`).
"""
