"""The server uses the engine only through its public API, so engine internals can change under it."""

from __future__ import annotations

import ast
from pathlib import Path

import ember.server

# Public engine modules and the names the server may take from each (None: any name).
PUBLIC_ENGINE_API = {
    "ember.engine.async_engine": {"AsyncEngine"},
    "ember.engine.llm": {"LLM"},
    "ember.engine.sampling_params": None,
    "ember.engine.outputs": None,
    "ember.engine.args": None,
    "ember.engine.errors": None,
}


def test_server_imports_only_the_engines_public_api():
    server_dir = Path(ember.server.__file__).parent
    offending = []
    for path in sorted(server_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ember.engine"):
                allowed = PUBLIC_ENGINE_API.get(node.module, set())
                names = {alias.name for alias in node.names}
                if allowed is not None and not names <= allowed:
                    offending.append(f"{path.name}: from {node.module} import {', '.join(sorted(names))}")
            elif isinstance(node, ast.Import):
                offending += [
                    f"{path.name}: import {a.name}" for a in node.names if a.name.startswith("ember.engine")
                ]
    assert offending == []
