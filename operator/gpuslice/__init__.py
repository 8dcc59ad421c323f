"""gpuslice: fixed GPU slices for Kubernetes tenants, allocated by kube-scheduler through DRA."""

__version__ = "0.1.0"
