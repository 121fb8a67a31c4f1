"""Hypothesis strategies for hostile HTTP requests, and the one property every answer must have.

Import it as `fuzz_requests` (tests/fuzz/conftest.py puts this folder on sys.path). A request is
a `FuzzRequest` (method, path, query, headers, body bytes); `answer_problem(response, request)` says
what is wrong with the answer, or None: it must be a 2xx/3xx/4xx, every 4xx is OpenAI's
`{"error": {"message", "type", "param", "code"}}` in JSON, and a stream ends with `data: [DONE]` or
an error event.

Budget: EMBER_FUZZ_EXAMPLES examples per test (default 100; `make test` runs with the default and a
fixed seed, so its runs are reproducible). Setting the variable also draws fresh random examples.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("EMBER_FUZZ_EXAMPLES", "100"))
# No request of a fuzz case may take longer: longer is a hang.
REQUEST_TIMEOUT_S = 30.0

fuzz_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,  # the per-request timeout is the hang check; a loaded 2-core machine is slow
    derandomize="EMBER_FUZZ_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)


@dataclass
class FuzzRequest:
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    query: dict[str, str] = field(default_factory=dict)

    def send(self, client: httpx.Client) -> httpx.Response:
        return client.request(
            self.method, self.path, content=self.body, headers=self.headers, params=self.query,
            timeout=REQUEST_TIMEOUT_S,
        )  # fmt: skip


def send_and_check(client: httpx.Client, request: FuzzRequest) -> None:
    """Send `request`; fail on a broken answer. Statuses show with --hypothesis-show-statistics."""
    response = request.send(client)
    event(f"status {response.status_code}")
    problem = answer_problem(response, request)
    assert problem is None, problem


def answer_problem(response: httpx.Response, request: FuzzRequest) -> str | None:
    """What breaks the contract in `response` (None: nothing)."""
    where = f"{request.method} {request.path} -> {response.status_code}"
    if response.status_code >= 500:
        return f"{where}: a server error: {response.text[:500]!r}"
    if response.status_code < 400:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return stream_problem(response.text, where)
        return None
    if request.method == "HEAD":
        return None  # no body by definition
    try:
        error = response.json()["error"]
        fields_ok = isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        if fields_ok and "param" in error and "code" in error:
            return None
    except (ValueError, KeyError, TypeError):
        pass
    return f"{where}: not OpenAI's error shape: {response.text[:500]!r}"


def stream_problem(text: str, where: str) -> str | None:
    """An SSE answer ends with `data: [DONE]` or an error event in OpenAI's shape."""
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    if events and events[-1] == "[DONE]":
        return None
    if events:
        try:
            error = json.loads(events[-1])["error"]
            if isinstance(error["message"], str) and isinstance(error["type"], str):
                return None
        except (ValueError, KeyError, TypeError):
            pass
    return f"{where}: a stream that neither ends with [DONE] nor an error event: {text[-500:]!r}"


# --- JSON values ------------------------------------------------------------------------------------

EDGE_NUMBERS = st.sampled_from(
    [0, -1, 1, 2**31, 2**53 + 1, 2**63, -(2**63) - 1, 2**64, 10**30, 1e308, -1e308, 1e-320, 0.5, -0.0,
     float("nan"), float("inf"), float("-inf")]
)  # fmt: skip
TEXT = st.text(max_size=24) | st.sampled_from(
    ["", " ", "\x00", "\ud7ff\ue000", "\ud800", "🔥" * 50, "a" * 3000, "</s>"]
)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | EDGE_NUMBERS | TEXT
JUNK = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


def to_json(value: Any) -> bytes:
    """JSON as a careless client writes it: NaN and Infinity as bare words, lone surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


# --- request bodies ---------------------------------------------------------------------------------

MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]), "content": TEXT}
)
SMALL_TOKENS = st.integers(min_value=1, max_value=4)
FUNCTION_NAMES = st.sampled_from(["get_weather", "add", "bad name!", ""])
PARAMETER_SCHEMAS = st.none() | st.sampled_from([
    {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
    {"type": "object"}, {"type": "nonsense"}, {"$ref": "#/nowhere"},
]) | JUNK  # fmt: skip
TOOLS = st.lists(
    st.fixed_dictionaries({"type": st.just("function")})
    | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": FUNCTION_NAMES, "parameters": PARAMETER_SCHEMAS})}),
    max_size=2,
)  # fmt: skip
TOOL_CHOICES = st.sampled_from(["none", "auto", "required", "sometimes"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": FUNCTION_NAMES})}
)
TOKEN_IDS = st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=6)

# Plausible values per field: a fuzz case mixes them with junk, so most requests are nearly valid
# and reach past the first check. Generation stays short (max_tokens 1-4) unless junk says otherwise.
SAMPLING_FIELDS: dict[str, st.SearchStrategy] = {
    "n": st.integers(min_value=1, max_value=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.1, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=50),
    "min_p": st.floats(min_value=0, max_value=1),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "seed": st.integers(min_value=0, max_value=2**32),
    "stop": TEXT | st.lists(TEXT, max_size=3),
    "stop_token_ids": TOKEN_IDS,
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(min_value=0, max_value=4),
    "logit_bias": st.dictionaries(st.integers(0, 100).map(str), st.floats(-100, 100), max_size=2),
    "priority": st.integers(min_value=-5, max_value=5),
    "user": TEXT,
    "prompt_logprobs": st.integers(min_value=0, max_value=3),
    "x_unknown_field": JUNK,
}
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "model": st.just("tiny"),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_tokens": SMALL_TOKENS,
    "max_completion_tokens": SMALL_TOKENS,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=0, max_value=5),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
    | st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": PARAMETER_SCHEMAS}),
        }
    ),
    "tools": TOOLS,
    "tool_choice": TOOL_CHOICES,
    "parallel_tool_calls": st.booleans(),
    "guided_choice": st.lists(TEXT, max_size=3),
    "guided_regex": st.sampled_from(["[a-z]{1,3}", "([a-z", "(ab)*"]) | TEXT,
    "structured_outputs": st.fixed_dictionaries({"choice": st.lists(TEXT, max_size=2)}) | JUNK,
    "add_generation_prompt": st.booleans(),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "model": st.just("tiny"),
    "prompt": TEXT
    | st.lists(TEXT, min_size=1, max_size=3)
    | TOKEN_IDS
    | st.lists(TOKEN_IDS, min_size=1, max_size=2),
    "max_tokens": SMALL_TOKENS,
    "echo": st.booleans(),
    "logprobs": st.integers(min_value=0, max_value=5),
    "best_of": st.integers(min_value=1, max_value=2),
    "suffix": TEXT,
}
TOKENIZE_FIELDS = {
    "model": st.just("tiny"),
    "prompt": TEXT,
    "messages": st.lists(MESSAGE, min_size=1, max_size=2),
    "tools": TOOLS,
    "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(),
}
DETOKENIZE_FIELDS = {"model": st.just("tiny"), "tokens": TOKEN_IDS}
ASYNC_FIELDS = {
    "webhook_url": st.sampled_from(
        ["http://127.0.0.1:1/hook", "https://example.invalid/h", "ftp://x", "not a url"]
    ),
    "max_time_in_queue_seconds": st.integers(min_value=1, max_value=600),
    "priority": st.integers(min_value=0, max_value=2),
}
ADMIN_KEY_FIELDS = {
    "name": TEXT,
    "models": st.lists(st.sampled_from(["*", "tiny", "other"]), max_size=2),
    "priority": st.integers(min_value=0, max_value=3),
    "max_priority": st.integers(min_value=0, max_value=3),
    "rpm": st.integers(min_value=1, max_value=1000),
    "tpm": st.integers(min_value=1, max_value=10**6),
    "max_concurrent": st.integers(min_value=1, max_value=8),
    "token_budget": st.integers(min_value=1, max_value=10**6),
    "default_deadline_ms": st.integers(min_value=1, max_value=60_000),
}
BATCH_FIELDS = {
    "input_file_id": st.sampled_from(["file-missing", ""]) | TEXT,
    "endpoint": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
    "completion_window": st.sampled_from(["24h", "1h", ""]),
    "metadata": st.dictionaries(TEXT, TEXT, max_size=2),
}
# The required fields, and max_tokens so that generation stays short: in most requests, now and then dropped.
USUALLY_PRESENT = {
    "messages", "prompt", "model", "tokens", "name", "input_file_id", "endpoint", "completion_window", "max_tokens"
}  # fmt: skip


@st.composite
def json_object(draw: st.DrawFn, fields: dict[str, st.SearchStrategy]) -> dict:
    """A request object: the usually present fields (each now and then dropped) plus a few others,
    each plausible or (one time in ten) junk."""
    optional = sorted(name for name in fields if name not in USUALLY_PRESENT)
    chosen = [name for name in fields if name in USUALLY_PRESENT and draw(st.integers(0, 9)) > 0]
    chosen += draw(st.lists(st.sampled_from(optional), max_size=2, unique=True)) if optional else []
    return {name: draw(JUNK) if draw(st.integers(0, 9)) == 0 else draw(fields[name]) for name in chosen}


DEEP_NESTING = st.integers(min_value=50, max_value=200_000).map(lambda depth: b"[" * depth + b"]" * depth)
RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [b"", b"{", b"null", b"[]", b'"text"', b"{}", b'{"model": NaN}', b"\xff\xfe{}", b"{" * 5000]
    ),
    DEEP_NESTING,
    JUNK.map(to_json),
)


def json_body(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[bytes]:
    """Mostly near-valid objects, sometimes any JSON or raw bytes."""
    return st.one_of(json_object(fields).map(to_json), json_object(fields).map(to_json), RAW_BODIES)


# --- headers, queries, paths --------------------------------------------------------------------------

# h11 (under httpx) refuses to send a header value with whitespace at either end.
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30).map(str.strip)
CONTENT_TYPES = [
    "application/json", "application/json; charset=utf-8", None, "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data", "multipart/form-data; boundary=x", "application/json; charset=utf-16", "*/*",
]  # fmt: skip
EMBER_HEADERS = [
    {"x-ember-priority": "x"}, {"x-ember-priority": "99999999999999999999"}, {"x-ember-deadline-ms": "NaN"},
    {"x-ember-deadline-ms": "-5"}, {"x-ember-region": "nowhere"}, {"x-ember-session-id": "s" * 500},
    {"accept": "text/html"}, {"content-encoding": "gzip"},
]  # fmt: skip


def mostly(draw: st.DrawFn, usual: object, others: list) -> object:
    """`usual` in about 2 draws of 3 (so most requests get past the header checks), else one of
    `others` or (one time in ten) any header text."""
    choice = draw(st.integers(0, 29))
    if choice < 20:
        return usual
    return draw(HEADER_TEXT) if choice < 23 else draw(st.sampled_from(others))


@st.composite
def headers(draw: st.DrawFn, key: str) -> dict[str, str]:
    """Authorization in every spelling (right key, wrong keys, other schemes), Content-Type, and
    Ember's own headers with bad values."""
    authorizations = [f"bearer {key}", f"Bearer  {key}", f"BEARER {key}", None, "Bearer", f"Basic {key}", key,
                      "Bearer sk-wrong", f"Bearer {key}x"]  # fmt: skip
    result = {
        "authorization": mostly(draw, f"Bearer {key}", authorizations),
        "content-type": mostly(draw, CONTENT_TYPES[0], CONTENT_TYPES[1:]),
        **draw(st.sampled_from([{}, {}, {}, *EMBER_HEADERS])),
    }
    return {name: value for name, value in result.items() if value is not None}


QUERIES = st.dictionaries(
    st.sampled_from(["limit", "after", "include_revoked", "order", "stream", "purpose", "x"]),
    HEADER_TEXT,
    max_size=3,
)
METHODS = st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
PATH_JUNK = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="?#%"), max_size=40
)


def paths(known: list[str]) -> st.SearchStrategy[str]:
    """A known route, a known route with a junk tail, or junk."""
    known_path = st.sampled_from(known)
    junk_path = PATH_JUNK.map(lambda text: "/" + text.lstrip("/"))  # "//x" would name a host, not a path
    return st.one_of(known_path, known_path, st.tuples(known_path, PATH_JUNK).map("/".join), junk_path)
