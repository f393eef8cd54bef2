"""The tinker wire's sampling constraint (ours, beyond Tinker: docs/tinker-surface.md): asample's `constraint`, a
JSON schema, a regex or a Lark grammar the samples must match, enforced by the built-in sampler's grammar mask.

Through the real tinker SDK with the workbench's hook (sdk_hooks: `sample(..., constraint=...)`, the SDK's own
request carrying the field), on the tiny random stand-in at temperature 1: whatever it writes under a constraint
is the mask's doing. The logprobs are the model's own (compute_logprobs gives the same). As raw JSON: a bad
constraint is a 400 naming it, an unknown field is still refused, and sampling_params' extras reach the sampler.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import tinker
from tinker import types

from test_hardening_input import refused
from test_service_http import Api
from test_structured_outputs import SMALL
from workbench.client import sdk_hooks

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def sampler(tinker_server):
    sdk_hooks.install()
    service = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    return service.create_sampling_client(base_model=BASE).result()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return types.ModelInput.from_ints(tokenizer("Answer:", add_special_tokens=False)["input_ids"])


def test_a_constraint_sent_through_the_sdk_holds_every_sample(sampler, prompt, tokenizer):
    params = types.SamplingParams(max_tokens=40, temperature=1.0, seed=3)
    texts = lambda result: [tokenizer.decode(s.tokens) for s in result.sequences]  # noqa: E731

    for text in texts(sampler.sample(prompt, 6, params, constraint={"json_schema": SMALL}).result()):
        jsonschema.validate(json.loads(text), SMALL)
    for text in texts(sampler.sample(prompt, 6, params, constraint={"regex": r"(yes|no), \d{1,3}"}).result()):
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}", text), text
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/\n'
    for text in texts(sampler.sample(prompt, 6, params, constraint={"lark": lark}).result()):
        assert re.fullmatch(r"The answer is [1-9][0-9]?\.", text), text
    # The same request without one is the stand-in's noise: the constraint, not the model, made the above.
    assert not any(re.fullmatch(r"(yes|no), [0-9]{1,3}", t) for t in texts(sampler.sample(prompt, 6, params).result()))


def test_the_logprobs_under_a_constraint_are_the_models_own(sampler, prompt):
    (seq,) = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=20, temperature=1.0, seed=5),
                            constraint={"json_schema": SMALL}).result().sequences
    full = types.ModelInput.from_ints(prompt.to_ints() + list(seq.tokens))
    scored = sampler.compute_logprobs(full).result()[prompt.length:]
    assert scored == pytest.approx(seq.logprobs, abs=1e-3)


def test_a_bad_constraint_through_the_sdk_is_a_clear_error(sampler, prompt):
    with pytest.raises(tinker.BadRequestError, match=r"constraint\.regex cannot be enforced.*unclosed"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4), constraint={"regex": "[a-"}).result()


def test_the_constraint_as_raw_json(tinker_server):
    """What a client without the hook sends: `constraint` beside the SDK's SampleRequest fields."""
    api = Api(tinker_server)
    session = api.session()
    sampler_id = api.post("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                       "base_model": BASE}).json()["sampling_session_id"]
    body = {"sampling_session_id": sampler_id, "num_samples": 1, "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": [1, 2, 3]}]}, "sampling_params": {"max_tokens": 8}}
    reply = api.post("/asample", {**body, "seq_id": 0, "constraint": {"regex": "[0-9]{3}"}})
    assert reply.status_code == 200 and api.wait(reply.json()["request_id"]).status_code == 200

    for constraint, needle in [({"regex": "[a-"}, "constraint.regex"), ({"lark": "start: nowhere"}, "constraint.lark"),
                               ({"json_schema": []}, "constraint.json_schema must be a JSON schema object"),
                               ({"regex": "a", "lark": "start: x"}, "must be one of"), ("[0-9]", "must be one of"),
                               ({"lark": "x" * 70000}, "more than the 65536")]:
        refused(api.post("/asample", {**body, "seq_id": 1, "constraint": constraint}), 400, needle)
    misspelt = api.post("/asample", {**body, "seq_id": 1, "constrain": {"regex": "a"}})  # unknown fields: refused
    assert misspelt.status_code == 422 and "constrain" in misspelt.json()["detail"], misspelt.text
    # sampling_params' extras (min_p, ...) are read, not dropped: an out-of-range one is refused by name.
    refused(api.post("/asample", {**body, "seq_id": 1, "sampling_params": {"max_tokens": 2, "min_p": 5}}), 400, "min_p")
