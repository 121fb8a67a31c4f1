"""`helm template` for exactly the template language deploy/helm/ember uses (Helm cannot be installed on
these machines: neither Debian nor PyPI ship it):

    {{ EXPR }}   {{ EXPR | quote }}   {{ required "message" EXPR | quote }}
    {{- toYaml EXPR | nindent N }}    {{- if EXPR }} ... {{- end }} around a whole file

where EXPR is `.Release.Namespace`, `.Values.a.b` or `(index .Values.a "key").b`. Anything else in a
template is an error, so the chart cannot use a construct this renderer would get wrong silently.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ACTION = re.compile(r"(\s*)\{\{(-?) (.+?) \}\}")
EXPRESSION = re.compile(r'^\(index (\S+) "([^"]+)"\)((?:\.\w+)*)$|^(\.\w+(?:\.\w+)*)$')


class TemplateError(Exception):
    pass


def evaluate(expression: str, context: dict[str, Any]) -> Any:
    match = EXPRESSION.match(expression)
    if match is None:
        raise TemplateError(f"unsupported expression {expression!r}")
    inner, key, rest, plain = match.groups()
    if plain is not None:
        value: Any = context
        for part in plain.strip(".").split("."):
            value = value[part]
        return value
    value = evaluate(inner, context)[key]
    for part in rest.strip(".").split(".") if rest else []:
        value = value[part]
    return value


def _to_yaml(value: Any, indent: int) -> str:
    text = yaml.safe_dump(value, sort_keys=True).rstrip("\n")
    return "".join("\n" + " " * indent + line for line in text.split("\n"))


def _action(body: str, context: dict[str, Any]) -> str:
    if match := re.fullmatch(r"toYaml (.+) \| nindent (\d+)", body):
        return _to_yaml(evaluate(match.group(1), context), int(match.group(2)))
    if match := re.fullmatch(r'required "([^"]+)" (.+) \| quote', body):
        value = evaluate(match.group(2), context)
        if not value:
            raise TemplateError(match.group(1))
        return json.dumps(str(value))
    if match := re.fullmatch(r"(.+) \| quote", body):
        return json.dumps(str(evaluate(match.group(1), context)))
    return str(evaluate(body, context))


def render_template(text: str, context: dict[str, Any]) -> str:
    if match := re.fullmatch(r"\{\{- if (.+?) \}\}\n(.*)\{\{- end \}\}\n", text, re.DOTALL):
        if not evaluate(match.group(1), context):
            return ""
        text = match.group(2)

    def action(found: re.Match) -> str:
        space, trim, body = found.groups()
        return ("" if trim else space) + _action(body, context)

    return ACTION.sub(action, text)


def helm_template(chart: Path, namespace: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects `helm template --namespace NAMESPACE chart -f values` prints."""
    context = {"Values": values, "Release": {"Namespace": namespace}}
    objects = []
    for template in sorted((chart / "templates").glob("*.yaml")):
        rendered = render_template(template.read_text(encoding="utf-8"), context)
        objects += [obj for obj in yaml.safe_load_all(rendered) if obj]
    return objects
