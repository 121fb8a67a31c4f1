"""Benchmark workloads: every dataset yields conversations of one or more turns.

Single-turn datasets (random, shared-prefix, sharegpt) give one-turn conversations; `multi-turn` gives
sessions whose later turns carry the whole history (earlier prompts and the server's replies)."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ember.errors import EmberError

if TYPE_CHECKING:  # the loader imports torch; the CLI builds its parser from this module without it
    from ember.loader import Tokenizer

DATASET_NAMES = ("random", "shared-prefix", "sharegpt", "multi-turn")

SHAREGPT_HELP = (
    "ShareGPT-format JSON (a list of {\"conversations\": [{\"from\": \"human\", \"value\": ...}, "
    "{\"from\": \"gpt\", \"value\": ...}, ...]}). The file vLLM and SGLang benchmark with is "
    "ShareGPT_V3_unfiltered_cleaned_split.json from the Hugging Face dataset "
    "anon8231489123/ShareGPT_Vicuna_unfiltered (download it once, then pass its local path)."
)

# Re-tokenizing decoded random ids rarely gives back the same count; a few corrections always converge
# with the word-token pool below.
_MAX_LENGTH_FIXES = 32


@dataclass(frozen=True)
class Turn:
    text: str  # this turn's new user text (for single-turn datasets: the whole prompt)
    prompt_len: int  # tokens of `text` as the tokenizer counts them (history excluded)
    output_len: int  # max_tokens of the request


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int

    @classmethod
    def parse(cls, text: str, what: str) -> LengthRange:
        """`N` or `LO:HI` (inclusive)."""
        try:
            parts = [int(p) for p in str(text).split(":")]
        except ValueError:
            raise EmberError(f"{what} must be N or LO:HI with integers, got {text!r}") from None
        if len(parts) == 1:
            parts = parts * 2
        if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
            raise EmberError(f"{what} must be N or LO:HI with 1 <= LO <= HI, got {text!r}")
        return cls(parts[0], parts[1])

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@functools.lru_cache(maxsize=4)
def word_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Tokens that decode to " <letters>" and encode back to themselves (cached: a sweep reuses them)."""
    vocab_ids = list(range(tokenizer.vocab_size))
    texts = [tokenizer.decode([i]) for i in vocab_ids]
    candidates = [i for i, t in zip(vocab_ids, texts, strict=True)
                  if len(t) >= 3 and t[0] == " " and t[1:].isascii() and t[1:].isalpha()]
    encoded = tokenizer.encode_batch([texts[i] for i in candidates], add_special_tokens=False)
    words = [i for i, ids in zip(candidates, encoded, strict=True) if ids == [i]]
    if len(words) < 100:
        raise EmberError("the tokenizer has too few whole-word tokens to build random prompts")
    return tuple(words)


class PromptGenerator:
    """Random text with an exact token count under a given tokenizer.

    Text is built from whole-word tokens (" word"), which re-tokenize to themselves, so a prefix keeps its
    tokens when a suffix is appended (prefix caches see the shared prefix) and corrections converge."""

    def __init__(self, tokenizer: Tokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.word_ids = word_token_ids(tokenizer)

    def count(self, text: str) -> int:
        """Tokens the server sees for `text` sent as a completion prompt (special tokens included)."""
        return len(self.tokenizer.encode(text))

    def text(self, num_tokens: int, prefix: str = "") -> str:
        """Random words such that `prefix + text` counts `count(prefix) + num_tokens` tokens."""
        target = self.count(prefix) + num_tokens if prefix else num_tokens
        ids = [self.rng.choice(self.word_ids) for _ in range(num_tokens)]
        text = self.tokenizer.decode(ids)
        for _ in range(_MAX_LENGTH_FIXES):
            surplus = self.count(prefix + text) - target
            if surplus == 0:
                return text
            if surplus > 0:
                ids = ids[: max(len(ids) - surplus, 0)]
            else:
                ids = ids + [self.rng.choice(self.word_ids) for _ in range(-surplus)]
            text = self.tokenizer.decode(ids)
        raise EmberError(f"could not build a prompt of exactly {num_tokens} tokens with this tokenizer")


def random_dataset(tokenizer: Tokenizer, num_prompts: int, input_len: LengthRange, output_len: LengthRange,
                   seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    generator = PromptGenerator(tokenizer, rng)
    conversations = []
    for _ in range(num_prompts):
        n_in, n_out = input_len.draw(rng), output_len.draw(rng)
        conversations.append(Conversation((Turn(generator.text(n_in), n_in, n_out),)))
    return conversations


def shared_prefix_dataset(tokenizer: Tokenizer, num_prompts: int, num_groups: int, prefix_len: int,
                          input_len: LengthRange, output_len: LengthRange, seed: int) -> list[Conversation]:
    """`num_groups` long shared prefixes (a system prompt); each request adds `input_len` fresh tokens.

    Requests are shuffled across groups so a prefix cache (or a cache-aware router) has to find them."""
    if num_groups < 1:
        raise EmberError(f"--num-groups must be at least 1, got {num_groups}")
    rng = random.Random(seed)
    generator = PromptGenerator(tokenizer, rng)
    prefixes = [generator.text(prefix_len) for _ in range(num_groups)]
    conversations = []
    for i in range(num_prompts):
        prefix = prefixes[i % num_groups]
        n_suffix, n_out = input_len.draw(rng), output_len.draw(rng)
        prompt = prefix + generator.text(n_suffix, prefix=prefix)
        conversations.append(Conversation((Turn(prompt, generator.count(prompt), n_out),)))
    rng.shuffle(conversations)
    return conversations


def multi_turn_dataset(tokenizer: Tokenizer, num_sessions: int, turns: int, input_len: LengthRange,
                       output_len: LengthRange, seed: int) -> list[Conversation]:
    """Sessions of `turns` user messages; each request resends the whole history plus the new message."""
    if turns < 1:
        raise EmberError(f"--turns must be at least 1, got {turns}")
    rng = random.Random(seed)
    generator = PromptGenerator(tokenizer, rng)
    conversations = []
    for _ in range(num_sessions):
        session = []
        for _ in range(turns):
            n_in, n_out = input_len.draw(rng), output_len.draw(rng)
            session.append(Turn(generator.text(n_in), n_in, n_out))
        conversations.append(Conversation(tuple(session)))
    return conversations


def sharegpt_dataset(tokenizer: Tokenizer, path: Path, num_prompts: int, seed: int,
                     output_len: int | None = None) -> list[Conversation]:
    """First human turn as the prompt; the reference reply's token count as max_tokens (vLLM's rules:
    skip prompts or replies under 4 tokens, prompts over 1024 and pairs over 2048 tokens)."""
    try:
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EmberError(f"--dataset-path {path}: no such file. {SHAREGPT_HELP}") from None
    except (OSError, ValueError) as exc:
        raise EmberError(f"--dataset-path {path}: not a readable JSON file ({exc})") from None
    if not isinstance(records, list):
        raise EmberError(f"--dataset-path {path}: expected a JSON list. {SHAREGPT_HELP}")
    pairs = []
    for record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value"), turns[1].get("value")
        if isinstance(prompt, str) and isinstance(reply, str):
            pairs.append((prompt, reply))
    random.Random(seed).shuffle(pairs)
    conversations = []
    for prompt, reply in pairs:
        if len(conversations) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt))
        reply_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 4 or (output_len is None and reply_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + reply_len > 2048:
            continue
        conversations.append(Conversation((Turn(prompt, prompt_len, reply_len),)))
    if not conversations:
        raise EmberError(f"--dataset-path {path}: no usable conversations. {SHAREGPT_HELP}")
    return conversations
