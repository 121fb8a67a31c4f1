"""Engine flags on the command line: the server's defaults differ from the offline commands' where
vLLM's do (the per-step token budget), and every engine field has a flag."""

from __future__ import annotations

import dataclasses

import pytest

from ember.cli import build_parser
from ember.engine.args import SERVING_MAX_NUM_BATCHED_TOKENS, EngineArgs
from ember.errors import EmberError


def parse(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(build_parser().parse_args(list(argv)))


def test_server_steps_are_smaller_than_offline_steps() -> None:
    assert parse("serve").max_num_batched_tokens == SERVING_MAX_NUM_BATCHED_TOKENS == 256
    assert parse("generate", "--prompt", "hi").max_num_batched_tokens == EngineArgs().max_num_batched_tokens == 1024
    assert parse("serve", "--max-num-batched-tokens", "2048").max_num_batched_tokens == 2048


def test_every_engine_field_is_a_flag_with_its_default() -> None:
    args = parse("generate", "--prompt", "hi", "--kernels", "torch")
    assert args.kernels == "torch"
    defaults = EngineArgs()
    for field in dataclasses.fields(EngineArgs):
        if field.name != "kernels":
            assert getattr(args, field.name) == getattr(defaults, field.name), field.name


def test_kv_cache_dtype_takes_vllms_flag_and_refuses_unknown_formats() -> None:
    assert parse("serve", "--kv-cache-dtype", "int8").kv_cache_dtype == "int8"
    assert parse("serve").kv_cache_dtype == "auto"
    with pytest.raises(EmberError, match="kv_cache_dtype must be one of auto, int8, got 'fp8'"):
        EngineArgs(kv_cache_dtype="fp8")
