"""What the autoscaler last reported to the gateway, for the console's fleet view.

The autoscaler runs in `ember up` (or `ember autoscale`), not in the gateway. After each round it PUTs
its status (its /status document: each model's bounds, desired count and replicas, and its decision
log) to the gateway's /admin/autoscaler with the control token it already registers replicas with.
The gateway keeps the last report in memory and never calls the autoscaler, so it needs neither its
address nor its code; a report that stops coming shows its age instead of going stale unseen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

# The autoscaler's decision log holds 200 (DECISION_LOG_SIZE in ember.control.autoscaling.autoscaler,
# which the gateway does not import); more in one report is refused, bounding the gateway's memory.
MAX_DECISIONS = 200
MAX_REPLICAS_PER_MODEL = 1000
DECISIONS_SHOWN = 10  # per model, newest first
COUNTED_STATES = ("loading", "ready")  # what the autoscaler counts as current (draining ones are leaving)


class ReportedReplica(BaseModel):
    id: str
    state: str


class ReportedModel(BaseModel):
    min_replicas: int
    max_replicas: int
    desired: int | None  # None until the model's first round
    replicas: list[ReportedReplica] = Field(max_length=MAX_REPLICAS_PER_MODEL)


class ReportedDecision(BaseModel):
    time: str
    model: str
    current: int
    desired: int
    reason: str
    detail: str


class AutoscalerReport(BaseModel):
    models: dict[str, ReportedModel]
    # Oldest first, as the autoscaler logs them.
    decisions: list[ReportedDecision] = Field(max_length=MAX_DECISIONS)


class LastAutoscalerReport:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.report: AutoscalerReport | None = None
        self.received_at: float | None = None

    def store(self, report: AutoscalerReport) -> None:
        self.report, self.received_at = report, self.clock()

    def for_model(self, name: str) -> dict[str, Any] | None:
        """The model's current and desired counts and last decisions, or None if never reported."""
        model = None if self.report is None else self.report.models.get(name)
        if model is None:
            return None
        decisions = [d.model_dump() for d in reversed(self.report.decisions) if d.model == name]
        return {
            "current": sum(1 for replica in model.replicas if replica.state in COUNTED_STATES),
            "desired": model.desired,
            "replicas_by_state": {
                state: sum(1 for replica in model.replicas if replica.state == state)
                for state in sorted({replica.state for replica in model.replicas})
            },
            "reported_s_ago": round(self.clock() - self.received_at, 1),
            "decisions": decisions[:DECISIONS_SHOWN],
        }
