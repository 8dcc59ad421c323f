"""A Kubernetes label selector (matchLabels / matchExpressions), as the API writes it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gpuslice.api.camel import CamelModel


class LabelSelectorRequirement(CamelModel):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)


class LabelSelector(CamelModel):
    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, alias="matchExpressions")
