"""End to end on ember itself: `ember bench serve` against a real `ember serve` subprocess, and
`ember bench offline` (with the transformers baseline) on the tiny model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ember.bench.datasets import LengthRange, random_dataset
from ember.bench.tokenizer import load_bench_tokenizer
from ember.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ember_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = tmp_path_factory.mktemp("ember-serve") / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--model", str(tiny_model_dir),
                                 "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "0.05",
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"ember serve exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"ember serve not ready:\n{log_path.read_text()}"
            try:
                if httpx.get(f"{url}/ready", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bench_serve_against_ember(ember_server, tiny_model_dir, tmp_path, api):
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", ember_server, "--api", api, "--num-prompts", "4",
               "--input-len", "16:48", "--output-len", "8:24", "--max-concurrency", "2", "--seed", "3",
               "--disable-progress", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
    assert result["model"] == str(tiny_model_dir)  # discovered from /v1/models; also names the tokenizer
    requested = random_dataset(load_bench_tokenizer(str(tiny_model_dir)), 4, LengthRange(16, 48),
                               LengthRange(8, 24), seed=3)
    # Usage-based counts equal the requested lengths (ignore_eos), request by request.
    assert sorted(result["output_lens"]) == sorted(c.turns[0].output_len for c in requested)
    if api == "completions":  # a chat prompt adds the template's tokens
        assert sorted(result["input_lens"]) == sorted(c.turns[0].prompt_len for c in requested)
    assert result["total_output_tokens"] == sum(c.turns[0].output_len for c in requested)
    assert len(result["itls"]) == result["total_output_tokens"] - 4  # one content chunk per token
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0 and result["output_throughput"] > 0
    assert result["peak_concurrency"] == 2


def test_bench_offline_with_hf_baseline(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", str(tiny_model_dir), "--dtype", "float32", "--num-threads", "1",
               "--num-prompts", "5", "--input-len", "8:24", "--output-len", "4:12", "--max-num-seqs", "2",
               "--kv-cache-memory", "0.05", "--seed", "1", "--baseline", "hf", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    for run in ("ember", "hf_sequential", "hf_static_batch"):
        assert set(result[run]) == {"output_throughput", "total_token_throughput", "request_throughput",
                                    "duration_s"}
        duration = result[run]["duration_s"]
        assert duration > 0
        assert result[run]["output_throughput"] == pytest.approx(result["total_output_tokens"] / duration)
        assert result[run]["request_throughput"] == pytest.approx(5 / duration)
    for key in ("hf_sequential", "hf_static_batch"):
        assert result[f"ratio_vs_{key}"] == pytest.approx(
            result["ember"]["output_throughput"] / result[key]["output_throughput"])
    assert 5 * 8 <= result["total_prompt_tokens"] <= 5 * 24 and 5 * 4 <= result["total_output_tokens"] <= 5 * 12
    assert result["dtype"] == "float32" and result["max_num_seqs"] == 2
    assert "ratio" in capsys.readouterr().out
