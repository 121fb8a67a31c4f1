"""The tokenizer a benchmark counts tokens with: the served model's own, loaded locally.

Random prompts need it to hit exact token lengths, and output tokens fall back to re-tokenizing the
generated text when a server sends no `usage`."""

from __future__ import annotations

import functools
from pathlib import Path

from ember.errors import EmberError, ModelLoadError
from ember.loader import Tokenizer, load_model, resolve_model


@functools.lru_cache(maxsize=4)
def load_bench_tokenizer(name: str) -> Tokenizer:
    """A model alias, a Hugging Face folder (only its tokenizer files are read) or a .gguf file.

    Cached: tokenizers are read-only, and a process that runs several benchmarks loads each once."""
    try:
        path = resolve_model(name)
        if path.is_dir():
            from ember.loader.hf import load_hf_tokenizer

            return load_hf_tokenizer(Path(path), eos_token_ids=[], bos_token_id=None)
        # A GGUF file keeps its vocabulary beside the weights; loading it is cheap for the small models
        # benchmarked on CPUs, and the loader is the one place that knows how to read it.
        return load_model(path, dtype="float32").tokenizer
    except ModelLoadError as exc:
        raise EmberError(f"cannot load the tokenizer {name!r} ({exc}); pass --tokenizer with the served "
                         f"model's alias, Hugging Face folder or .gguf file") from None
