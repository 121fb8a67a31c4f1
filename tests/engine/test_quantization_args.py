"""--quantization: a flag on every engine command with help text, and clear errors for the combinations it
does not run in (before any weight is read)."""

from __future__ import annotations

import re

import pytest

from ember.cli import build_parser
from ember.engine.args import QUANTIZATION_CHOICES, EngineArgs
from ember.errors import EmberError


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"], ["bench", "offline"]])
def test_every_engine_command_takes_the_flag(command: list[str]) -> None:
    for value in QUANTIZATION_CHOICES:
        assert (
            EngineArgs.from_cli_args(
                build_parser().parse_args([*command, "--quantization", value])
            ).quantization
            == value
        )


def test_unknown_values_are_refused_by_the_parser_with_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--quantization", "q4"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'q4' (choose from 'auto', 'none', 'gguf', 'int8')" in capsys.readouterr().err


def test_help_describes_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    # argparse wraps lines at hyphens too ("decode-" then "sized"): join those first, then the other breaks.
    help_text = " ".join(re.sub(r"-\n\s+", "-", capsys.readouterr().out).split())
    assert "--quantization {auto,none,gguf,int8}" in help_text and "dequantize in registers" in help_text
    assert "auto = with a .gguf file on CPU with native kernels, the blocks for decode-sized batches" in help_text
    assert "int8 copies run with int8 activations (W8A8; with AMX for decode steps of up to 64 rows" in help_text
    assert "(default: auto)" in help_text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization": "q4"}, "quantization must be one of auto, none, gguf, int8, got 'q4'"),
        (
            {"quantization": "int8", "kernels": "torch"},
            "runs on ember's native kernels, which --kernels torch turns off",
        ),
        (
            {"quantization": "gguf", "device": "cuda"},
            "runs on CPU kernels only; use --quantization none on cuda",
        ),
        ({"quantization": "gguf", "tensor_parallel_size": 2}, "not supported with tensor parallelism"),
    ],
)
def test_unsupported_combinations_fail_clearly(options: dict, message: str) -> None:
    with pytest.raises(EmberError, match=message):
        EngineArgs(**options)


@pytest.mark.parametrize(
    ("options", "device", "expected"),
    [
        ({}, "cpu", "auto"),
        ({}, "cuda", "none"),
        ({"kernels": "torch"}, "cpu", "none"),
        ({"tensor_parallel_size": 2}, "cpu", "none"),
        ({"quantization": "none"}, "cpu", "none"),
        ({"quantization": "gguf"}, "cpu", "gguf"),
    ],
)
def test_auto_keeps_the_blocks_only_where_the_native_cpu_kernels_run(
    options: dict, device: str, expected: str
) -> None:
    """The default, auto, never refuses a combination: it means none wherever the quantized kernels cannot
    run (CUDA, --kernels torch, tensor parallelism)."""
    assert EngineArgs(**options).quantization_for(device) == expected
