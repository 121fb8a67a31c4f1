"""Grammar-constrained decoding: a request's structured-output spec (JSON schema, any JSON object, regex,
choice, EBNF grammar) compiles once per distinct spec into a grammar; each sequence decoding under it holds
its own matcher, which fills that sequence's row of the step's allowed-token bitmask and accepts the
tokens the step appends.

The backend (xgrammar) stays behind StructuredOutputManager, GrammarMatcher and apply_bitmask: nothing else
in the engine imports it."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from ember.engine.errors import InvalidRequestError
from ember.engine.structured_output.spec import StructuredOutputSpec
from ember.kernels.native import NativeKernels
from ember.loader.tokenizer import Tokenizer

# Distinct compiled grammars kept; a compiled JSON schema is tens of KB to a few MB.
GRAMMAR_CACHE_SIZE = 256


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_compiled", "_matcher")

    def __init__(self, compiled) -> None:
        import xgrammar

        self._compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def fresh(self) -> GrammarMatcher:
        """A matcher at the start of the same grammar (for a forked sibling, which has no output yet)."""
        return GrammarMatcher(self._compiled)

    def accept(self, token_id: int) -> bool:
        """Advance past token_id; False (and no move) if the grammar does not allow it here."""
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear the tokens the grammar does not allow next from bitmask[row]. A grammar that has accepted
        its stop token (a sequence going on with ignore_eos) constrains nothing more: the row stays open."""
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_bitmask_through(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> None:
        """Fill bitmask[row] for the next token and bitmask[row + 1 + j] for the token after draft[: j + 1],
        as far as the grammar takes the draft; the matcher ends where it started. The rows after a draft token
        the grammar refuses stay open: that token is masked out at its own row, so the sampler rejects it and
        never reads them."""
        self.fill_bitmask(bitmask, row)
        advanced = 0
        for token_id in draft:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                break
            advanced += 1
            self.fill_bitmask(bitmask, row + advanced)
        if advanced:
            self._matcher.rollback(advanced)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A step's allowed-token bitmask, [num_rows, ceil(vocab/32)] int32, every token allowed."""
    import xgrammar

    return xgrammar.allocate_token_bitmask(num_rows, vocab_size)


def fill_bitmasks(bitmask: torch.Tensor, rows: list[tuple[int, GrammarMatcher]]) -> torch.Tensor:
    """Fill each (row, matcher)'s row of bitmask (from allocate_bitmask) by its matcher; rows without a
    matcher keep every token allowed. Runs no torch op: it is called on the mask thread (model_runner.py)."""
    for row, matcher in rows:
        matcher.fill_bitmask(bitmask, row)
    return bitmask


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], native: NativeKernels | None = None
) -> None:
    """Set the disallowed tokens' logits of `rows` to -inf, in place (the other rows are untouched).

    bfloat16 logits go through the native kernel where there is one: a masked vector store per bitmask word,
    over 10x faster than xgrammar's CPU kernel, which walks the tokens one by one (docs/benchmarks.md)."""
    if native is not None and logits.dtype == torch.bfloat16 and logits.is_contiguous():
        native.apply_token_bitmask(logits, bitmask, rows)
        return
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


class StructuredOutputManager:
    """Compiles specs into grammars for one tokenizer, once per distinct spec (LRU), from any thread.

    xgrammar is imported and its tokenizer info built at the first constrained request, so an engine that
    never sees one pays nothing."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler = None
        self._cache: OrderedDict[StructuredOutputSpec, object] = OrderedDict()
        self._lock = threading.Lock()

    def matcher_for(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """A matcher at the start of spec's grammar; InvalidRequestError naming spec.param if it does not
        compile."""
        return GrammarMatcher(self.compile(spec))

    def compile(self, spec: StructuredOutputSpec):
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        try:
            compiled = self._compile(spec)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - the backend raises RuntimeError/ValueError kinds for bad specs
            raise InvalidRequestError(f"invalid {spec.param}: {exc}".strip(), param=spec.param) from None
        with self._lock:
            self._cache[spec] = compiled
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputSpec):
        compiler = self._grammar_compiler()
        if spec.kind == "json":
            schema = json.loads(spec.value)
            if not isinstance(schema, dict):
                raise InvalidRequestError(f"{spec.param}: a JSON schema must be an object", param=spec.param)
            return compiler.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            if not choices or not all(isinstance(choice, str) and choice for choice in choices):
                raise InvalidRequestError(
                    f"{spec.param} must be a non-empty list of non-empty strings", param=spec.param
                )
            # An EBNF string literal escapes like a JSON string.
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.value)
        raise InvalidRequestError(f"unknown structured output kind {spec.kind!r}", param=spec.param)

    def _grammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                hf = self._tokenizer.hf_tokenizer
                vocab = [hf.id_to_token(token_id) or "" for token_id in range(hf.get_vocab_size(True))]
                metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
                info = xgrammar.TokenizerInfo(
                    vocab,
                    metadata["vocab_type"],
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids,
                    add_prefix_space=metadata["add_prefix_space"],
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler
