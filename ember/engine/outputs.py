"""What the engine hands back: vLLM's output shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the matched stop string or stop token id


@dataclass
class RequestMetrics:
    """Timestamps are time.monotonic() seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason is then "abort")
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob entry (None for the first token);
    # once the whole prompt is scored (output_kind "delta": in one output only).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class SpecDecodeStats:
    """Speculative decoding totals, as vLLM's spec_decode_* counters."""

    num_drafts: int = 0  # decodes that carried draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position k

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preempted_total: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off
