"""`ember serve --tensor-parallel-size 2`: serves through two ranks; when its worker is killed, the server
turns unready and exits non-zero instead of hanging, so a supervisor (ember up, Kubernetes) restarts it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess


def worker_pids(server_pid: int) -> list[int]:
    """The server's tensor-parallel workers: its children started by multiprocessing's spawn (not its
    resource tracker)."""
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    return [pid for pid in children if "spawn_main" in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except FileNotFoundError:
        return ""


@pytest.mark.slow
def test_killed_worker_makes_serve_exit_non_zero(tiny_model_dir, tmp_path):
    server = ServerProcess(tiny_model_dir, tmp_path / "serve.log", "--tensor-parallel-size", "2")
    try:
        response = httpx.post(f"{server.url}/v1/completions", timeout=60.0, json={
            "model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200
        assert len(response.json()["choices"][0]["text"]) > 0
        workers = worker_pids(server.proc.pid)
        assert len(workers) == 1, "one tensor-parallel worker expected"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
        assert "exited with code -9" in server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
