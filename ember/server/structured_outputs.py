"""The request fields that constrain the output (OpenAI's response_format, vLLM's structured_outputs and its
older guided_* fields) mapped to the engine's StructuredOutputSpec."""

from __future__ import annotations

from ember.engine.errors import InvalidRequestError
from ember.engine.sampling_params import StructuredOutputSpec
from ember.server.protocol import SamplingFields, StructuredOutputsParams


def structured_output_spec(request: SamplingFields) -> StructuredOutputSpec | None:
    """The one constraint the request sets, or None; InvalidRequestError naming the field when it sets
    several or one is malformed (a schema that does not compile is the engine's to refuse)."""
    specs = [spec for spec in (_response_format(request), _structured_outputs(request.structured_outputs),
                               *_guided(request)) if spec is not None]
    if len(specs) > 1:
        raise InvalidRequestError(
            f"give one output constraint, got {len(specs)}: {', '.join(spec.param for spec in specs)}",
            param=specs[1].param)
    return specs[0] if specs else None


def _response_format(request: SamplingFields) -> StructuredOutputSpec | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputSpec("json_object", "", "response_format")
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.json_schema is None:
        raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                  param="response_format")
    return StructuredOutputSpec.json_schema(json_schema.json_schema, "response_format")


def _structured_outputs(params: StructuredOutputsParams | None) -> StructuredOutputSpec | None:
    if params is None:
        return None
    param = "structured_outputs"
    given = [spec for spec in (
        StructuredOutputSpec.json_schema(params.json_schema, param) if params.json_schema is not None else None,
        StructuredOutputSpec("regex", params.regex, param) if params.regex is not None else None,
        StructuredOutputSpec.choice(params.choice, param) if params.choice is not None else None,
        StructuredOutputSpec("grammar", params.grammar, param) if params.grammar is not None else None,
        StructuredOutputSpec("json_object", "", param) if params.json_object else None,
    ) if spec is not None]
    if len(given) != 1:
        raise InvalidRequestError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                                  "json_object", param=param)
    return given[0]


def _guided(request: SamplingFields) -> list[StructuredOutputSpec | None]:
    return [
        StructuredOutputSpec.json_schema(request.guided_json, "guided_json")
        if request.guided_json is not None else None,
        StructuredOutputSpec("regex", request.guided_regex, "guided_regex")
        if request.guided_regex is not None else None,
        StructuredOutputSpec.choice(request.guided_choice, "guided_choice")
        if request.guided_choice is not None else None,
        StructuredOutputSpec("grammar", request.guided_grammar, "guided_grammar")
        if request.guided_grammar is not None else None,
    ]
