"""Grammar-constrained decoding in the engine, through the offline LLM API with the real SmolLM2."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ember.engine.errors import InvalidRequestError
from ember.engine.llm import LLM
from ember.engine.sampling_params import SamplingParams
from ember.engine.structured_output.spec import StructuredOutputSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONVERSATION = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path):
    return LLM(str(smollm2_gguf_path), num_threads=1)


def test_unconstrained_rows_are_token_identical_beside_constrained_ones(llm):
    """A batch mixing grammar rows with plain rows leaves the plain rows' tokens exactly as they are alone;
    the constrained rows validate."""
    plain = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24),
    ]
    constrained = SamplingParams(
        temperature=0, max_tokens=60, structured_output=StructuredOutputSpec.json_schema(SCHEMA, "test")
    )
    alone = llm.chat([CONVERSATION] * 2, plain)
    mixed = llm.chat([CONVERSATION] * 4, [constrained, plain[0], constrained, plain[1]])
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == [
        alone[0].outputs[0].token_ids,
        alone[1].outputs[0].token_ids,
    ]
    for output in (mixed[0], mixed[2]):
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)


def test_n_siblings_and_sampling_follow_the_grammar(llm):
    spec = StructuredOutputSpec.choice(["alpha", "beta", "gamma"], "test")
    (output,) = llm.chat(
        [CONVERSATION], SamplingParams(n=6, temperature=1.5, seed=1, max_tokens=8, structured_output=spec)
    )
    texts = [choice.text for choice in output.outputs]
    assert len(texts) == 6 and set(texts) <= {"alpha", "beta", "gamma"}
    assert all(choice.finish_reason == "stop" for choice in output.outputs)


def test_drafts_are_checked_against_the_grammar(llm, smollm2_gguf_path):
    """With n-gram speculation, grammar rows take drafts too, each draft row masked under the grammar
    advanced through the drafts before it: drafts the grammar allows and the model picks are accepted, the
    others rejected, so greedy outputs are token-identical to decoding without drafts, and sampled ones
    follow the grammar."""
    speculative = LLM(
        str(smollm2_gguf_path),
        num_threads=1,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    examples = (
        'People: {"name": "Alice", "age": 30}, {"name": "Bob", "age": 41}, {"name": "Carol", "age": 27}.'
    )
    prompts = [
        f"{examples} Another person as JSON: ",
        "abababab abab",
        f"{examples} Is Bob older than Alice? ",
    ]
    greedy = [
        SamplingParams(
            temperature=0, max_tokens=40, structured_output=StructuredOutputSpec.json_schema(SCHEMA, "test")
        ),
        SamplingParams(
            temperature=0, max_tokens=12, structured_output=StructuredOutputSpec("regex", "(ab){4}")
        ),
        SamplingParams(
            temperature=0, max_tokens=8, structured_output=StructuredOutputSpec.choice(["yes", "no"], "t")
        ),
    ]
    expected = [output.outputs[0] for output in llm.generate(prompts, greedy)]
    got = [output.outputs[0] for output in speculative.generate(prompts, greedy)]
    assert [output.token_ids for output in got] == [output.token_ids for output in expected]
    assert got[1].text == "abababab" and got[2].text in ("yes", "no")
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
    spec = speculative.engine.stats().spec_decode
    # Drafts were proposed for the grammar rows, some accepted and some refused.
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec

    sampled = SamplingParams(
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=40,
        structured_output=StructuredOutputSpec.json_schema(SCHEMA, "test"),
    )
    (output,) = speculative.generate([prompts[0]], sampled)
    for choice in output.outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_a_schema_that_does_not_compile_is_refused_with_its_param(llm):
    spec = StructuredOutputSpec("regex", "([a-z", "guided_regex")
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_output=spec))
    assert error.value.param == "guided_regex"


def test_a_grammar_that_can_only_end_beats_min_tokens(llm):
    """min_tokens bans the stop tokens; once the grammar allows nothing else, the grammar wins (it used to
    leave no token at all)."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        min_tokens=12,
        structured_output=StructuredOutputSpec("choice", '["yes", "no"]', "test"),
    )
    completion = llm.generate(["Is water wet? Answer:"], params)[0].outputs[0]
    assert completion.text in ("yes", "no") and completion.finish_reason == "stop"
