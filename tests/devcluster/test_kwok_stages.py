"""kwok's stages as the devcluster runs them: a Job's pod completes at once unless it carries the
keep-running annotation; every other stage is kwok's own."""

from __future__ import annotations

import yaml

from gpuslice_dev.devcluster.components import KWOK_KEEP_RUNNING, kwok_stages

SHIPPED = """
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: '.status.podIP', operator: 'DoesNotExist'}
  next:
    statusTemplate: |
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-complete
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: '.metadata.ownerReferences.[].kind', operator: 'In', values: ['Job']}
  next:
    statusTemplate: |
      phase: Succeeded
"""


def test_only_pod_complete_gains_the_keep_running_exception() -> None:
    shipped = list(yaml.safe_load_all(SHIPPED))
    ours = list(yaml.safe_load_all(kwok_stages(SHIPPED)))
    assert [d["metadata"]["name"] for d in ours] == ["pod-ready", "pod-complete"]
    assert ours[0] == shipped[0]
    assert ours[1]["spec"]["next"] == shipped[1]["spec"]["next"]
    assert ours[1]["spec"]["selector"]["matchExpressions"] == [
        *shipped[1]["spec"]["selector"]["matchExpressions"],
        {"key": f'.metadata.annotations["{KWOK_KEEP_RUNNING}"]', "operator": "DoesNotExist"},
    ]
