"""Development tooling of gpuslice, a distribution of its own (`gpuslice-dev`, in `devtools/`):
the local devcluster, the demo, the GPU simulator (the Python side of the NVIDIA driver test double,
`gpuslice-dev shim run`), the image builder and the builders of the Go tools the tests use.

It works from a checkout only (it builds the shim and reads `crds/` and `manifests/`; the repository
root is computed once, in `gpuslice_dev.paths`). Nothing in the product package `gpuslice` imports
it: tests/test_layers.py enforces that, and tests/test_packaging.py that the product's wheel holds
none of it.
"""
