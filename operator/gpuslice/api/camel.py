"""The base of the product's API models: Kubernetes spells fields in camelCase."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class CamelModel(BaseModel):
    """Fields carry their camelCase wire name as alias and accept either spelling; unknown fields are
    ignored, as the API server's structural pruning would drop them anyway."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")
