"""Compile time and per-token mask time of the grammar backends (xgrammar, the engine's; llguidance, the
other candidate) on the 20 test schemas (tests/structured/schemas.py), with SmolLM2's tokenizer.

    PYTHONPATH=. .venv/bin/python benchmarks/engine/structured_output.py [--steps 64]

Compile: a cold compile of each schema (no cache). Mask: the time to fill one row's allowed-token bitmask,
per step of a walk through the grammar that takes a random allowed token each step (seeded), up to --steps
tokens or the grammar's end. Used for docs/benchmarks.md, "Structured output"."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar
from transformers import PreTrainedTokenizerFast

from ember.loader import load_model
from tests.conftest import smollm2_gguf
from tests.structured.schemas import SCHEMAS


def allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    bits = ((bitmask[0].view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size]
    return bits.nonzero().flatten().tolist()


def walk(fill, accept, done, vocab_size: int, bitmask: torch.Tensor, steps: int, rng: random.Random) -> list[float]:
    """Seconds per mask fill along one random walk through the grammar."""
    times = []
    for _ in range(steps):
        if done():
            break
        start = time.perf_counter()
        fill(bitmask)
        times.append(time.perf_counter() - start)
        choices = allowed_ids(bitmask, vocab_size)
        if not choices:
            break
        token = rng.choice(choices)
        if not accept(token):
            break
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    tokenizer = load_model(str(smollm2_gguf()), dtype="float32", device=torch.device("cpu")).tokenizer
    hf = tokenizer.hf_tokenizer
    vocab_size = hf.get_vocab_size(True)
    eos = tokenizer.eos_token_ids

    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
    vocab = [hf.id_to_token(i) or "" for i in range(vocab_size)]
    info = xgrammar.TokenizerInfo(vocab, metadata["vocab_type"], vocab_size=vocab_size, stop_token_ids=eos,
                                  add_prefix_space=metadata["add_prefix_space"])
    ll_tokenizer = llguidance.hf.from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=hf), n_vocab=vocab_size,
                                                eos_token=eos[0])

    results: dict[str, tuple[list[float], list[float]]] = {"xgrammar": ([], []), "llguidance": ([], [])}
    for model in SCHEMAS:
        schema = json.dumps(model.model_json_schema())
        # xgrammar: a fresh compiler per schema, so nothing is cached.
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        results["xgrammar"][0].append(time.perf_counter() - start)
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        results["xgrammar"][1].extend(walk(lambda mask, m=matcher: m.fill_next_token_bitmask(mask, 0),
                                       matcher.accept_token, matcher.is_terminated, vocab_size, bitmask, args.steps, random.Random(0)))
        # llguidance: compiling happens when the matcher is built.
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        ll_matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        results["llguidance"][0].append(time.perf_counter() - start)
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        results["llguidance"][1].extend(walk(
            lambda mask, m=ll_matcher: llguidance.torch.fill_next_token_bitmask(m, mask, 0),
            ll_matcher.consume_token, ll_matcher.is_stopped, vocab_size, bitmask, args.steps, random.Random(0)))
    for name, (compiles, masks) in results.items():
        masks_us = sorted(t * 1e6 for t in masks)
        print(f"{name:11s} compile ms: median {statistics.median(compiles) * 1e3:7.2f}  max "
              f"{max(compiles) * 1e3:7.2f} | mask us/token: median {statistics.median(masks_us):7.1f}  p99 "
              f"{masks_us[int(len(masks_us) * 0.99)]:7.1f}  mean {statistics.mean(masks_us):7.1f} "
              f"({len(masks_us)} steps)")


if __name__ == "__main__":
    main()
