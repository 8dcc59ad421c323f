"""pydantic models of gpuslice's public API (group gpuslice.io, version v1alpha1)."""
