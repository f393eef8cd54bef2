"""Constrained decoding (kernel_backend/engine/constraints.py, kernel_backend/grammars.py): a grammar's allowed
tokens mask a row's logits, so what the schema promises holds every time.

In the engine, on the tiny random stand-in at temperature 1 (a model that writes noise: whatever it outputs
under a grammar is the mask's doing): constrained rows validate, rows without a grammar in the same batch draw
what they draw alone, logprobs are the model's own, a grammar compiles once, bad schemas are refused.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from kernel_backend import grammars
from kernel_backend.errors import UserError
from kernel_backend.types import SampleOptions, SamplingParams

# A schema a random model completes within a few dozen tokens: bounded values only.
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "color": {"enum": ["red", "green", "blue"]}},
         "required": ["ok", "n", "color"], "additionalProperties": False}


def _sample(engine, prompt, n, params, grammar=None):
    request = engine.sample_request(None, prompt, n, params, SampleOptions(grammar=grammar))
    return request


def test_constrained_rows_validate_beside_unconstrained_ones(engine, tokenizer):
    prompt = tokenizer("Answer in JSON:", add_special_tokens=False)["input_ids"]
    grammar = grammars.json_grammar(SMALL, "schema")
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    alone = engine.run_requests([_sample(engine, prompt, 4, params)])[0]
    constrained, free = engine.run_requests([_sample(engine, prompt, 8, params, grammar),
                                             _sample(engine, prompt, 4, params)])
    for seq in constrained.sequences:
        assert seq.stop_reason == "stop"  # the grammar completed: the row stopped
        jsonschema.validate(json.loads(tokenizer.decode(seq.tokens)), SMALL)
    # Rows without a grammar draw exactly what they draw alone: the mask touches constrained rows only.
    assert [s.tokens for s in free.sequences] == [s.tokens for s in alone.sequences]
    # ...and they are noise, which the grammar's rows are not: the test above is the mask's doing.
    assert not any(tokenizer.decode(s.tokens).startswith('{"') for s in free.sequences)


def test_logprobs_are_the_models_own(engine, tokenizer):
    prompt = tokenizer("JSON:", add_special_tokens=False)["input_ids"]
    result = engine.run_requests([_sample(engine, prompt, 2, SamplingParams(max_tokens=30, temperature=1.0, seed=3),
                                          grammars.json_grammar(SMALL, "schema"))])[0]
    for seq in result.sequences:
        recomputed = engine.compute_logprobs(None, prompt + seq.tokens)[len(prompt):]
        assert recomputed == pytest.approx(seq.logprobs, abs=1e-3)
        # Under the mask the drawn tokens would have had probability ~1 where the grammar forces them; the
        # model's own logprobs of this random model's are far below that.
        assert min(seq.logprobs) < -5


def test_greedy_is_masked_too_and_a_grammar_compiles_once(engine, tokenizer):
    prompt = tokenizer("Say yes or no:", add_special_tokens=False)["input_ids"]
    grammar = 'start: "yes" | "no"\n'
    before = engine.grammars().compiles
    for _ in range(2):
        (seq,) = engine.run_requests([_sample(engine, prompt, 1, SamplingParams(max_tokens=8, temperature=0.0),
                                              grammar)])[0].sequences
        assert tokenizer.decode(seq.tokens) in ("yes", "no") and seq.stop_reason == "stop"
    assert engine.grammars().compiles == before + 1


def test_end_of_sequence_only_where_the_grammar_accepts(engine, tokenizer):
    """A grammar that may go on after it accepts: the row stops at its end-of-sequence token, never before."""
    prompt = tokenizer("Digits:", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    result = engine.run_requests([_sample(engine, prompt, 8, params, "start: /[0-9]{2,6}/\n")])[0]
    for seq in result.sequences:
        text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        assert text.isdigit() and 2 <= len(text) <= 6, text


@pytest.mark.parametrize("schema, named", [
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"$ref": "#/definitions/missing"}, "/definitions/missing"),
    ({"type": "string", "minLength": "three"}, "minLength"),
])
def test_a_schema_that_cannot_be_enforced_names_why(schema, named):
    with pytest.raises(UserError, match=named):
        grammars.json_grammar(schema, "response_format.json_schema.schema")


def test_grammar_size_is_bounded_before_any_work(engine, tokenizer):
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(UserError, match="bytes as a grammar"):
        grammars.json_grammar(huge, "schema")
    with pytest.raises(UserError, match="bytes as a grammar"):  # the engine bounds what reaches it another way too
        engine.sample_request(None, [1, 2, 3], 1, SamplingParams(max_tokens=4), SampleOptions(grammar="x" * 70000))


def test_the_vllm_sampler_refuses_a_grammar_rather_than_ignore_it():
    from kernel_backend.execution.vllm_sampler import VllmSampling

    with pytest.raises(UserError, match="constrained decoding .* not supported by this server's sampler"):
        VllmSampling.check_options(SampleOptions(grammar='start: "a"\n'))
