"""Ember: a self-hosted LLM inference platform."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:
    from ember.engine.llm import LLM
    from ember.engine.sampling_params import SamplingParams

# Importing `ember` stays cheap (no torch): the offline API loads on first use.
_LAZY = {"LLM": "ember.engine.llm", "SamplingParams": "ember.engine.sampling_params"}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
