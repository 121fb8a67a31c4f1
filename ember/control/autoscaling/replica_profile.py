"""How fast one replica is: the profile `ember profile` measures, and what the policy and the simulators
read from it (prefill throughput, decode step by batch size, cold start, concurrency)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MeasuredPoint(BaseModel):
    """One measurement of `ember profile`: x is a prompt length (tokens) or a batch size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    x: int
    seconds: float


class ReplicaProfile(BaseModel):
    """How fast one replica is (a JSON file for `ember simulate --profile`, written by `ember profile`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str | None = Field(default=None, description="What was measured (informational)")

    prefill_tokens_per_s: float = Field(
        gt=0, description="Prompt tokens prefilled per second, one prompt at a time"
    )
    decode_step_s: float = Field(gt=0, description="One decode step with one sequence")
    decode_step_per_seq_s: float = Field(
        ge=0, description="Added to a step per further sequence in the batch"
    )
    max_batch: int = Field(gt=0, description="Concurrent requests per replica (the gateway's capacity)")
    cold_start_s: float = Field(ge=0, description="Process start to serving")
    cost_per_replica_hour: float | None = Field(
        default=None,
        ge=0,
        description="This hardware's price; overrides the fleet file's when comparing hardware",
    )
    ttft_by_prompt_tokens: list[MeasuredPoint] = Field(
        default_factory=list, description="What the fit came from"
    )
    step_by_batch: list[MeasuredPoint] = Field(default_factory=list, description="What the fit came from")

    def step_s(self, batch: int) -> float:
        return self.decode_step_s + self.decode_step_per_seq_s * max(batch - 1, 0)
