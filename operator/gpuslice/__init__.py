"""gpuslice: fixed GPU slices for Kubernetes tenants, allocated by kube-scheduler through DRA."""

#: The release number, the one source of it: the package metadata, `gpuslice --version`, the start-up
#: logs, `gpuslice_build_info`, the chart and the image tags follow it (tests/test_release.py).
__version__ = "0.2.0"
