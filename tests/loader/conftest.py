"""Loader fixtures: the real SmolLM2 GGUF loaded once per session, by Ember and by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf_path: Path) -> LoadedModel:
    return load_model(smollm2_gguf_path, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)
