"""Label selector matching, as kube-apiserver does it, for entitlement namespace selectors."""

from __future__ import annotations

from collections.abc import Mapping

from gpuslice.api.package import LabelSelector


class SelectorError(ValueError):
    """A selector the API server would refuse; the CRD schema rejects these before they reach us."""


def matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """True when `labels` satisfy every matchLabels pair and every matchExpression.

    An empty selector matches everything, as in Kubernetes.
    """
    for key, value in selector.match_labels.items():
        if labels.get(key) != value:
            return False
    for req in selector.match_expressions:
        op = req.operator
        if op == "In":
            if labels.get(req.key) not in req.values:
                return False
        elif op == "NotIn":
            if req.key in labels and labels[req.key] in req.values:
                return False
        elif op == "Exists":
            if req.key not in labels:
                return False
        elif op == "DoesNotExist":
            if req.key in labels:
                return False
        else:
            raise SelectorError(f"unknown selector operator {op!r}: use In, NotIn, Exists or DoesNotExist")
    return True
