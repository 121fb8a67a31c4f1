"""What the fuzz tests talk to: a process under fuzz, its URL and key (fixtures in conftest.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

SERVER_KEY = "sk-fuzz-server"
GATEWAY_KEY = "sk-fuzz-gateway"
ADMIN_KEY = "sk-fuzz-admin"


class FuzzTarget:
    """A process under fuzz: its URL, the key it accepts, and whether it still serves."""

    def __init__(self, process: subprocess.Popen, url: str, key: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.key = key
        self.log_path = log_path
        self.client = httpx.Client(base_url=url)

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"the process died: {self.log_path.read_text()[-3000:]}"
        assert self.client.get("/health", timeout=10).status_code == 200
