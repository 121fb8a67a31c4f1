"""The one pydantic base of Ember's configuration files (gateway config, its `async:` section, the
fleet file's `launch:`, routing options)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys are errors, so a misspelt setting is reported instead of silently left at its
    default; values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)
