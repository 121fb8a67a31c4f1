"""`ember bench serve` / `sweep` against the scripted SSE server: every metric against its known value."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import tokenizers

from ember.cli import main

# Client-side timing on a shared, busy 2-core machine: a latency can only come out longer than scripted
# (loopback and scheduling delays), so it is checked against [scripted, scripted + SLACK_MS]. Gaps between
# chunks are scheduled at absolute times, so their averages stay within GAP_TOLERANCE_MS. The exact
# arithmetic on given timings is tested in test_bench_metrics.py.
SLACK_MS = 250.0
GAP_TOLERANCE_MS = 25.0


def assert_at_least(value: float, scripted: float) -> None:
    assert scripted <= value <= scripted + SLACK_MS


def _bench(server_url: str, tiny_model_dir: Path, tmp_path: Path, *extra: str, command: str = "serve") -> dict:
    out = tmp_path / "result.json"
    rc = main(["bench", command, "--base-url", server_url, "--tokenizer", str(tiny_model_dir),
               "--disable-progress", "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_metrics_match_the_script(scripted_server, tiny_model_dir, tmp_path, capsys):
    # 8 requests of 5 tokens, 4 at a time: two waves of 200 + 4 * 50 = 400 ms each.
    result = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--num-prompts", "8",
                    "--max-concurrency", "4", "--input-len", "20", "--output-len", "5",
                    "--percentiles", "50,90")
    assert result["model"] == "scripted-model"  # discovered through /v1/models
    assert result["completed"] == 8 and result["failed"] == 0 and result["errors"] == {}
    assert result["total_input_tokens"] == 8 * 20  # exact prompt lengths, counted by the server
    assert result["total_output_tokens"] == 8 * 5
    assert result["output_lens"] == [5] * 8
    for key in ("mean", "median", "p50", "p90", "p99"):
        assert_at_least(result[f"{key}_ttft_ms"], 200.0)
        assert_at_least(result[f"{key}_e2el_ms"], 400.0)
        assert result[f"{key}_tpot_ms"] == pytest.approx(50.0, abs=GAP_TOLERANCE_MS)
    assert result["mean_itl_ms"] == pytest.approx(50.0, abs=GAP_TOLERANCE_MS)
    assert result["median_itl_ms"] == pytest.approx(50.0, abs=GAP_TOLERANCE_MS)
    assert len(result["itls"]) == 8 * 4  # every gap between content chunks, pooled
    assert 0.8 <= result["duration"] <= 0.8 + 2 * SLACK_MS / 1000
    assert result["request_throughput"] == pytest.approx(8 / result["duration"])
    assert result["output_throughput"] == pytest.approx(40 / result["duration"])
    assert result["total_token_throughput"] == pytest.approx((160 + 40) / result["duration"])
    assert result["peak_concurrency"] == 4
    # The first wave's 20 tokens land inside the first second; the second wave's around its end.
    assert sum(result["output_throughput_per_second"]) == 40
    assert 20 <= result["peak_output_throughput"] == max(result["output_throughput_per_second"]) <= 40
    assert result["goodput"] is None and result["cost_per_1m_output_tokens_usd"] is None
    # Requests ask for what the workload says, streamed with usage.
    body = scripted_server.script.requests[0]
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    table = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in table
    assert "Successful requests:                     8" in table
    assert "P90 TTFT (ms):" in table and "Mean E2EL (ms):" in table


def test_chat_api_times_content_chunks_not_the_role_chunk(scripted_server, tiny_model_dir, tmp_path):
    result = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--api", "chat",
                    "--num-prompts", "2", "--input-len", "10", "--output-len", "3")
    assert result["completed"] == 2 and result["total_output_tokens"] == 6
    assert_at_least(result["mean_ttft_ms"], 200.0)
    assert result["mean_tpot_ms"] == pytest.approx(50.0, abs=GAP_TOLERANCE_MS)
    assert scripted_server.script.requests[0]["max_completion_tokens"] == 3


def test_output_tokens_fall_back_to_retokenizing(scripted_server, tiny_model_dir, tmp_path,
                                                  bench_tokenizer_file):
    scripted_server.script.send_usage = False
    result = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--num-prompts", "2",
                    "--input-len", "12", "--output-len", "4")
    tokenizer = tokenizers.Tokenizer.from_file(str(bench_tokenizer_file))
    expected = len(tokenizer.encode(" tok0 tok1 tok2 tok3", add_special_tokens=False).ids)
    assert result["output_lens"] == [expected, expected]
    assert result["total_input_tokens"] == 24  # the dataset's exact count stands in for usage


def test_server_errors_are_counted_with_status_and_message(scripted_server, tiny_model_dir, tmp_path):
    scripted_server.script.fail_every = 2
    result = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--num-prompts", "6",
                    "--input-len", "8", "--output-len", "2", "--max-concurrency", "1")
    assert result["completed"] == 3 and result["failed"] == 3
    assert result["errors"] == {"500: scripted failure": 3}
    assert result["total_output_tokens"] == 6


def test_timeouts_are_counted(scripted_server, tiny_model_dir, tmp_path):
    scripted_server.script.first_chunk_s = 3.0
    result = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--num-prompts", "2",
                    "--input-len", "8", "--output-len", "2", "--request-timeout", "0.5")
    assert result["completed"] == 0 and result["failed"] == 2
    assert result["errors"] == {"200: timeout (SocketTimeoutError)": 2}  # aiohttp's read timeout


def test_connection_refused_is_counted_not_raised(tiny_model_dir, tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket closes
    result = _bench(f"http://127.0.0.1:{port}", tiny_model_dir, tmp_path, "--model", "m",
                    "--num-prompts", "3", "--input-len", "8", "--output-len", "2")
    assert result["completed"] == 0 and result["failed"] == 3
    [(message, count)] = result["errors"].items()
    assert count == 3 and message.startswith("no response: ClientConnectorError")
    assert "Failed requests:                         3" in capsys.readouterr().out


def test_every_request_has_its_own_connection(scripted_server, tiny_model_dir, tmp_path):
    # Servers close kept-alive connections on their own schedule (llama.cpp's llama-server after 5 s
    # idle); a request sent on one the server is closing fails before the server sees it. Two at a
    # time, so that without a new connection per request the pool would hand the next one a used one.
    result = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--num-prompts", "6",
                    "--max-concurrency", "2", "--input-len", "8", "--output-len", "2", "--num-warmups", "2")
    assert result["completed"] == 6
    ports = scripted_server.script.client_ports
    assert len(ports) == 2 + 6 and len(set(ports)) == len(ports)


def test_goodput_and_cost_from_a_run(scripted_server, tiny_model_dir, tmp_path):
    # Both SLOs hold for every request (TTFT ~200 ms, TPOT ~50 ms); e2el 300 ms fails all of them.
    result = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--num-prompts", "4",
                    "--input-len", "8", "--output-len", "3", "--goodput", "ttft:1000", "tpot:200",
                    "--cost-per-hour", "3.6", "--instances", "2")
    assert result["goodput"] == pytest.approx(4 / result["duration"])
    expected = 7.2 / 3600 / result["output_throughput"] * 1e6
    assert result["cost_per_1m_output_tokens_usd"] == pytest.approx(expected)
    strict = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--num-prompts", "4",
                    "--input-len", "8", "--output-len", "3", "--goodput", "ttft:1000", "e2el:250")
    assert strict["goodput"] == 0.0


def test_multi_turn_sends_the_growing_history(scripted_server, tiny_model_dir, tmp_path):
    result = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--api", "chat",
                    "--dataset-name", "multi-turn", "--num-prompts", "2", "--turns", "3",
                    "--input-len", "6", "--output-len", "2")
    assert result["completed"] == 6
    by_length = sorted(len(r["messages"]) for r in scripted_server.script.requests)
    assert by_length == [1, 1, 3, 3, 5, 5]
    third = next(r for r in scripted_server.script.requests if len(r["messages"]) == 5)
    assert [m["role"] for m in third["messages"]] == ["user", "assistant"] * 2 + ["user"]
    assert third["messages"][1]["content"] == " tok0 tok1"
    assert "ignore_eos" not in third  # multi-turn lets the model stop


def test_ctrl_c_prints_the_partial_result(scripted_server, tiny_model_dir, tmp_path, capsys):
    scripted_server.script.sigint_on_request = 3
    out = tmp_path / "partial.json"
    rc = main(["bench", "serve", "--base-url", scripted_server.base_url, "--tokenizer", str(tiny_model_dir),
               "--disable-progress", "--json", str(out), "--num-prompts", "6", "--max-concurrency", "1",
               "--input-len", "8", "--output-len", "2"])
    assert rc == 130
    result = json.loads(out.read_text())
    assert result["interrupted"] is True
    assert result["completed"] == 2 and result["cancelled"] == 1
    assert "(interrupted: partial result)" in capsys.readouterr().out


def test_sweep_writes_one_result_per_point_and_a_plot(scripted_server, tiny_model_dir, tmp_path):
    plot = tmp_path / "sweep.png"
    results = _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--num-prompts", "4",
                     "--input-len", "8", "--output-len", "3", "--concurrency", "1,4", "--plot", str(plot),
                     command="sweep")
    assert [r["sweep_label"] for r in results] == ["c=1", "c=4"]
    assert [r["max_concurrency"] for r in results] == [1, 4]
    assert [r["peak_concurrency"] for r in results] == [1, 4]
    assert [r["seed"] for r in results] == [0, 1]  # fresh prompts per point
    assert results[0]["duration"] > 1.5 * results[1]["duration"]  # 4 x 300 ms in a row vs 300 ms at once
    assert plot.stat().st_size > 10_000


def test_serve_plot_is_written(scripted_server, tiny_model_dir, tmp_path):
    plot = tmp_path / "run.png"
    _bench(scripted_server.base_url, tiny_model_dir, tmp_path, "--num-prompts", "3", "--input-len", "8",
           "--output-len", "3", "--plot", str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
