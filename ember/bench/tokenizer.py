"""The tokenizer a benchmark counts tokens with: the served model's own, loaded locally.

Random prompts need it to hit exact token lengths, and output tokens fall back to re-tokenizing the
generated text when a server sends no `usage`."""

from __future__ import annotations

import functools

from ember.errors import EmberError, ModelLoadError
from ember.loader import Tokenizer, load_tokenizer


@functools.lru_cache(maxsize=4)
def load_bench_tokenizer(name: str) -> Tokenizer:
    """A model alias, a Hugging Face folder or a .gguf file (only the tokenizer is read).

    Cached: tokenizers are read-only, and a process that runs several benchmarks loads each once."""
    try:
        return load_tokenizer(name)
    except ModelLoadError as exc:
        raise EmberError(f"cannot load the tokenizer {name!r} ({exc}); pass --tokenizer with the served "
                         f"model's alias, Hugging Face folder or .gguf file") from None
