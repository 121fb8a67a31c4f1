"""Tensor-parallel loading reads each rank's slice of the checkpoint, never a full copy per rank: every rank
of `ember serve --tensor-parallel-size 2` materializes about half the weights of one rank (its resident
memory peaks about half as high while loading), and a model too large for one rank's memory allowance
(RLIMIT_DATA, which the workers inherit) fails to load on one rank but serves on two, answering with the
tokens one unlimited rank gives. For safetensors and GGUF (quantized) files written by the test."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import build_tiny_model_dir
from tests.loader.conftest import write_tiny_gguf
from tests.server.conftest import MODEL_NAME, ServerProcess

# ModelRunner's log line, one per rank.
LOAD_LINE = re.compile(
    r"rank (\d+) of \d+ loaded ([\d.]+) MiB of weights; resident memory peaked ([\d.]+) MiB"
)
PROMPTS = [[5, 6, 7, 8], [20, 21, 22, 23, 24, 25], [100, 3, 50]]


@pytest.fixture(scope="module")
def large_safetensors_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~330 MiB in float32, in many tensors: loading briefly holds one tensor twice (read, then converted),
    and the largest (the embedding and LM head, vocabulary-parallel) stay well below the margin between one
    rank's and two ranks' needs. Stored in bfloat16 (as most checkpoints are) and served in float32, so that
    the weights are converted into the process's own memory: a float32 file would be served from its memory
    map, which RLIMIT_DATA does not count."""
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("large-safetensors"),
        dtype=torch.bfloat16,
        hidden_size=256,
        intermediate_size=2048,
        num_hidden_layers=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def large_gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~270 MiB in float32, nearly all of it in the layers, stored in GGUF's quantized types."""
    path = tmp_path_factory.mktemp("large-gguf") / "large.gguf"
    return write_tiny_gguf(
        path, tied=False, dims=dict(hidden=512, intermediate=2048, layers=16, heads=8, kv_heads=4)
    ).path


def completions(server: ServerProcess) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        response = httpx.post(
            f"{server.url}/v1/completions",
            timeout=120.0,
            json={
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def load_reports(server: ServerProcess) -> dict[int, tuple[float, float]]:
    """rank -> (MiB of weights it loaded, MiB its resident memory peaked above the level before loading)."""
    return {int(m[1]): (float(m[2]), float(m[3])) for m in LOAD_LINE.finditer(server.log())}


# A process that exits while it is read: its /proc files vanish (FileNotFoundError) or, as a zombie, answer
# ESRCH (ProcessLookupError).
def data_bytes(pid: int) -> int:
    """The process's private writable memory (VmData): what RLIMIT_DATA limits; 0 once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return next(
        (int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmData:")), 0
    )


def is_python(pid: int) -> bool:
    """The server and its workers, not the C compiler a first start runs to build the kernels (it is the
    server's child on one rank and a worker's on two, so counting it would skew one side only)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith("python")
    except (FileNotFoundError, ProcessLookupError):
        return False


def children(pid: int | str) -> list[int]:
    try:
        return [
            int(c)
            for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()
        ]
    except (FileNotFoundError, ProcessLookupError):
        return []


def serves(pid: int, model: Path) -> bool:
    """An `ember serve` of this model. Any other python child pytest starts while a block samples (in full runs
    the two-rank peak once read 270 MB above its value alone, cause not found) is not this test's to count."""
    try:
        return str(model).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


class PeakData:
    """Samples the VmData of the `ember serve` processes of `model` this block starts and of their children
    (its tensor-parallel workers) while they start and serve: the most any one reached. Loading briefly needs
    more than serving (a tensor read, then converted; heap grown around temporaries), and the limit must allow
    for that."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.peaks: dict[int, int] = {}  # pid -> its peak: the server and, on two ranks, its worker
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakData:
        self._earlier = set(children("self"))
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            for server in set(children("self")) - self._earlier:
                if not serves(server, self.model):
                    continue
                for pid in [server, *children(server)]:
                    if is_python(pid):
                        self.peaks[pid] = max(self.peaks.get(pid, 0), data_bytes(pid))

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max(self.peaks.values(), default=0)


@pytest.mark.slow
@pytest.mark.parametrize("model_format", ["safetensors", "gguf"])
def test_ranks_load_their_slices_and_a_model_too_large_for_one_rank_serves_on_two(
    model_format, request, tmp_path
):
    model = request.getfixturevalue(f"large_{model_format}_model")
    with PeakData(model) as one_rank_data:
        # The weights dequantized at load, as each rank holds them (quantization auto is none under TP).
        one = ServerProcess(model, tmp_path / "tp1.log", "--quantization", "none")
        try:
            expected = completions(one)
        finally:
            one.stop()
    ((full_weights, full_peak),) = load_reports(one).values()

    with PeakData(model) as two_rank_data:
        two = ServerProcess(model, tmp_path / "tp2.log", "--tensor-parallel-size", "2")
        try:
            assert completions(two) == expected
        finally:
            two.stop()
    reports = load_reports(two)
    assert sorted(reports) == [0, 1]
    for weights, peak in reports.values():
        assert weights == pytest.approx(full_weights / 2, rel=0.02)  # half, plus the replicated norms
        # No full copy on the way. More than half: the peak counts the file pages read, and a row-parallel
        # rank's columns are a part of every row, so it reads most pages of those tensors.
        assert peak < 0.75 * full_peak, (reports, full_peak)

    # An allowance between what one rank needs with the whole model and what it needs with half of it, a
    # quarter of the way up from the latter: a sampled peak overstates the need (the heap keeps what it freed
    # while unlimited; under the limit it reuses it), and the midpoint let one rank load in some runs.
    peaks = (
        f"VmData peaks by pid: one rank {one_rank_data.peaks}, two ranks {two_rank_data.peaks} "
        f"(server pid {two.proc.pid})"
    )
    limit = two_rank_data.peak + (one_rank_data.peak - two_rank_data.peak) // 4
    try:
        # Stopped at once should it start after all, so a failing run leaves no server behind.
        # As the one-rank reference ran: with auto's blocks and int8 copies it would need less (Zen 4).
        ServerProcess(model, tmp_path / "tp1-limited.log", "--quantization", "none", data_limit=limit).stop()
    except RuntimeError as error:
        assert "ember serve exited with 1" in str(error)
    else:
        pytest.fail(f"one rank loaded the whole model within {limit} bytes ({peaks})")
    assert "cannot allocate memory" in (tmp_path / "tp1-limited.log").read_text().lower()
    limited = ServerProcess(
        model, tmp_path / "tp2-limited.log", "--tensor-parallel-size", "2", data_limit=limit
    )
    try:
        assert completions(limited) == expected
    finally:
        limited.stop()
