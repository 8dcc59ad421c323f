"""Python side of the NVIDIA driver test double and the shim outside Kubernetes (dev only)."""
