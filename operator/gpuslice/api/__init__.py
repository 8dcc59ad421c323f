"""pydantic models of gpuslice's public API (group gpuslice.io, version v1beta1; v1alpha1, the same
schema, is still served, deprecated)."""
