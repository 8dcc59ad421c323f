"""The CUDA intercept shim's Python side: build, limits file, usage region, driver test double, CLI.

The shim itself is C (`shim/` at the repository root); see shim/README.md for its design.
"""
