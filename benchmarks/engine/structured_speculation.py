"""Grammar-constrained decoding with and without n-gram speculation, offline, with SmolLM2: output tokens/s,
draft acceptance, and whether the greedy outputs are token-identical.

    PYTHONPATH=. .venv/bin/python benchmarks/engine/structured_speculation.py [--requests 16] [--rounds 2]

Each request asks for one more record under a JSON schema after a prompt of records in the same shape, so
prompt lookup finds drafts (keys, punctuation) that the grammar allows. The two engines run back to back,
alternating, --rounds times each. Used for docs/benchmarks.md, "Structured output"."""

from __future__ import annotations

import argparse
import time

from ember.engine.llm import LLM
from ember.engine.sampling_params import SamplingParams
from ember.engine.structured_output.spec import StructuredOutputSpec
from tests.conftest import smollm2_gguf

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "city": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
    },
    "required": ["name", "city", "age", "role"],
    "additionalProperties": False,
}
PEOPLE = [("Alice", "Paris", 30, "engineer"), ("Bob", "Oslo", 41, "teacher"), ("Carol", "Rome", 27, "doctor"),
          ("Dan", "Lima", 35, "artist"), ("Eve", "Cairo", 52, "engineer"), ("Finn", "Tokyo", 19, "teacher")]  # fmt: skip


def prompts(count: int) -> list[str]:
    out = []
    for i in range(count):
        rows = PEOPLE[i % len(PEOPLE) :] + PEOPLE[: i % len(PEOPLE)]
        records = "\n".join(
            f'{{"name": "{name}", "city": "{city}", "age": {age}, "role": "{role}"}}'
            for name, city, age, role in rows
        )
        out.append(f"Records of people, one JSON object a line:\n{records}\n")
    return out


def run(llm: LLM, texts: list[str], params: SamplingParams) -> tuple[float, int, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(texts, params)
    seconds = time.perf_counter() - start
    token_ids = [output.outputs[0].token_ids for output in outputs]
    return seconds, sum(map(len, token_ids)), token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    texts = prompts(args.requests)
    params = SamplingParams(
        temperature=0, max_tokens=64, structured_output=StructuredOutputSpec.json_schema(SCHEMA, "bench")
    )
    engines = {
        "plain": LLM(str(smollm2_gguf()), num_threads=args.num_threads),
        "ngram": LLM(
            str(smollm2_gguf()),
            num_threads=args.num_threads,
            speculative_config={"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens},
        ),
    }
    for llm in engines.values():  # warm-up: compiles the grammar, fills the prefix cache alike
        run(llm, texts[:2], params)
    outputs: dict[str, list[list[list[int]]]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        for name, llm in engines.items():
            seconds, tokens, token_ids = run(llm, texts, params)
            outputs[name].append(token_ids)
            print(
                f"round {round_index + 1} {name}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s"
            )
    spec = engines["ngram"].engine.stats().spec_decode
    print(f"drafts: {spec.num_draft_tokens} tokens proposed, {spec.num_accepted_tokens} accepted "
          f"({spec.num_accepted_tokens / max(spec.num_draft_tokens, 1):.0%}), per position {spec.accepted_per_position}")  # fmt: skip
    # Batched greedy decoding is itself not bit-stable from round to round (the later rounds' prompts come
    # from the prefix cache, so their prefill runs in other shapes): the first comparison is the baseline.
    print(
        f"greedy outputs identical, plain round 1 vs plain last round: {outputs['plain'][0] == outputs['plain'][-1]}"
    )
    print(
        f"greedy outputs identical, plain vs ngram, last round: {outputs['plain'][-1] == outputs['ngram'][-1]}"
    )


if __name__ == "__main__":
    main()
