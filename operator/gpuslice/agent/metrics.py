"""Prometheus metrics of the node agent."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

PUBLISHED_DEVICES = Gauge(
    "gpuslice_agent_published_devices", "Partition devices in this node's ResourceSlices"
)
PUBLISHED_SLICES = Gauge("gpuslice_agent_published_resourceslices", "ResourceSlices of this node's pool")
POOL_GENERATION = Gauge("gpuslice_agent_pool_generation", "Generation of this node's ResourceSlice pool")
PUBLISHES = Counter("gpuslice_agent_publishes", "Republishes of this node's pool (content changed)")
PREPARED_CLAIMS = Gauge("gpuslice_agent_prepared_claims", "ResourceClaims prepared on this node")
PREPARE_ERRORS = Counter("gpuslice_agent_prepare_errors", "NodePrepareResources claims that failed")
