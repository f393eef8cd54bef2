"""The training loop's core calls, written against the API that every tinker SDK since 0.6 shares, for
tests/test_sdk_versions.py: run with any released SDK first on PYTHONPATH against a server.

    PYTHONPATH=<folder with tinker==0.18.2> python tests/sdk_core_loop.py   # TINKER_BASE_URL, TINKER_API_KEY set

A LoRA client (seeded), forward, three forward_backward + optim_step, save_state, a sampler from the trained
weights (save_weights_for_sampler + create_sampling_client), sample, compute_logprobs of what it sampled, and a
training client made again from the saved state. It asserts what each call's reply must hold and prints one JSON
line: the SDK's version, the forward logprobs before and after training, the losses and the sampled sequence.
"""

import json
import math
import os

import tinker
from tinker import types

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]


def forward_logprobs(training, datum) -> list[float]:
    output = training.forward([datum], "cross_entropy").result()
    return output.loss_fn_outputs[0]["logprobs"].to_numpy().tolist()


service = tinker.ServiceClient(base_url=os.environ["TINKER_BASE_URL"], api_key=os.environ["TINKER_API_KEY"])
training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0)
datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                    loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})

before = forward_logprobs(training, datum)
assert len(before) == len(TOKENS) - 1 and all(math.isfinite(x) and x <= 0 for x in before), before
losses = []
for _ in range(3):
    losses.append(training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
after = forward_logprobs(training, datum)
assert -sum(after) < -sum(before), (before, after)

state = training.save_state("core-loop").result().path
sampler_path = training.save_weights_for_sampler("core-loop").result().path
sampler = service.create_sampling_client(model_path=sampler_path)
prompt = TOKENS[:3]
reply = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                       sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=1)).result()
assert len(reply.sequences) == 2, reply
sequence = reply.sequences[0]
assert len(sequence.tokens) == len(sequence.logprobs) == 5 and sequence.stop_reason == "length", sequence
recomputed = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + list(sequence.tokens))).result()
assert recomputed[0] is None and len(recomputed) == len(prompt) + 5, recomputed
assert max(abs(a - b) for a, b in zip(recomputed[len(prompt):], sequence.logprobs)) < 1e-3, (recomputed, sequence)

resumed = service.create_training_client_from_state(state)
assert max(abs(a - b) for a, b in zip(forward_logprobs(resumed, datum), after)) < 1e-5

print(json.dumps({"version": tinker.__version__, "before": before, "after": after, "losses": losses,
                  "sampled": list(sequence.tokens), "sampled_logprobs": list(sequence.logprobs)}), flush=True)
# The loop is done and its summary out. The SDK's own threads (its event loop, the session heartbeat) are still
# running, and interpreter finalization with them alive aborted once under tinker 0.24.1 (SIGABRT, exit -6, nothing
# on stderr, after this line was printed: a clean-clone run of 2026-12-05). What this script tests is the loop
# against our server, not the old SDK's teardown: leave without finalizing.
os._exit(0)
