"""What a request's output must match, as SamplingParams carries it (no backend import: the server and the
offline API build these)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar"]
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match. `value`: the JSON schema as JSON text (kind "json"), the regex, the
    choices as a JSON list of strings, the EBNF grammar (root rule `root`), or "" for "json_object".
    `param` names the request field it came from, so an invalid spec's 400 names it (not part of the key)."""

    kind: StructuredOutputKind
    value: str = ""
    param: str = field(default="structured_outputs", compare=False)

    @classmethod
    def json_schema(cls, schema: dict | str, param: str) -> StructuredOutputSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json", text, param)

    @classmethod
    def choice(cls, choices: list[str], param: str) -> StructuredOutputSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), param)
