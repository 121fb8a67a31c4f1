"""Per-request sampling parameters, with vLLM's field names and semantics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ember.engine.errors import InvalidSamplingParamsError
from ember.engine.structured_output.spec import (  # public: a SamplingParams field
    STRUCTURED_OUTPUT_KINDS,
    StructuredOutputSpec,
)

OutputKind = Literal["cumulative", "delta", "final"]
OUTPUT_KINDS = ("cumulative", "delta", "final")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = None  # None: up to the model's max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k count; 0 = only the sampled token's logprob
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: OutputKind = "cumulative"
    # Decode under a grammar (JSON schema, JSON object, regex, choice, EBNF); None: unconstrained.
    structured_output: StructuredOutputSpec | None = None
    # Derived in __post_init__; not constructor arguments.
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.stop_strings = tuple(self.stop)
        self.stop_token_set = frozenset(self.stop_token_ids)

    def _validate(self) -> None:
        def fail(name: str, message: str) -> None:
            raise InvalidSamplingParamsError(f"{name} {message}, got {getattr(self, name)!r}", param=name)

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be -1, 0 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must hold non-negative integers")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            fail("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            fail("prompt_logprobs", "must be an integer >= 0")
        if self.output_kind not in OUTPUT_KINDS:
            fail("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}")
        if self.structured_output is not None and (
            not isinstance(self.structured_output, StructuredOutputSpec)
            or self.structured_output.kind not in STRUCTURED_OUTPUT_KINDS
        ):
            fail("structured_output", f"must be a StructuredOutputSpec of kind {', '.join(STRUCTURED_OUTPUT_KINDS)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the next token's logits depend on the tokens before it (repetition, presence, frequency)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
