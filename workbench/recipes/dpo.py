"""DPO from preference labels: pairs of datums and a loss for `forward_backward_custom`.

    data = preference_datums(labeler.preferences(), tokenizer)   # [chosen0, rejected0, chosen1, ...]
    data = add_reference_logprobs(data, reference_client)         # optional, usually the starting policy
    fb = tc.forward_backward_custom(data, dpo_loss).result()      # or make_dpo_loss(beta=0.5)
    tc.optim_step(types.AdamParams(learning_rate=1e-5)).result()

Each datum is a next-token example over prompt + completion with weight 1 on the completion's
tokens only, so `logprobs @ weights` is log pi(completion | prompt). DPO (Rafailov et al., 2023):

    loss = -mean_pairs log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

The reference log-likelihoods ride along in loss_fn_inputs["ref_logprobs"] (the SDK hands every
loss_fn_inputs field to a custom loss but sends only target_tokens and weights to the server), and
so does a pair's confidence p (loss_fn_inputs["confidence"] of its chosen datum; 1 when absent),
which makes the label soft: loss = -(p log sigmoid(m) + (1 - p) log sigmoid(-m)) with m the
pair's beta-scaled margin, plain DPO at p = 1 (workbench/recipes/preference_labels.py says why strength maps to p).
Without them the reference terms are zero: a reference-free variant, fine for a first step from
the base model, where policy and reference coincide.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from tinker import types


def _ids(encoded) -> list[int]:
    """apply_chat_template answers a list or a BatchEncoding depending on the transformers version."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return [int(x) for x in encoded]


def encode_pair(prompt: str, completion: str, tokenizer, chat: bool = True) -> tuple[list[int], list[int]]:
    """(prompt tokens, prompt + completion tokens). With `chat` and a chat template, the prompt is a
    user turn and the completion the assistant's answer; otherwise plain text plus EOS."""
    if chat and getattr(tokenizer, "chat_template", None):
        user = [{"role": "user", "content": prompt}]
        prompt_ids = _ids(tokenizer.apply_chat_template(user, add_generation_prompt=True))
        full = _ids(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": completion}]))
        if full[: len(prompt_ids)] == prompt_ids:
            return prompt_ids, full
        # A template that rewrites the prompt once an answer follows: fall back to concatenation.
    else:
        prompt_ids = tokenizer.encode(prompt)
    return prompt_ids, prompt_ids + answer_ids(completion, tokenizer)


def answer_ids(completion: str, tokenizer) -> list[int]:
    """An answer's tokens as a sampler ends them: the text, then EOS (no chat template around it)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return list(tokenizer.encode(completion, add_special_tokens=False)) + eos


def completion_datum(prompt_tokens: list[int], full_tokens: list[int]) -> types.Datum:
    """Input full[:-1], targets full[1:], weight 1 where the target is a completion token."""
    if len(full_tokens) <= len(prompt_tokens):
        raise ValueError("the completion is empty")
    weights = np.zeros(len(full_tokens) - 1, dtype=np.float32)
    weights[len(prompt_tokens) - 1 :] = 1.0
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(full_tokens[:-1])),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.asarray(full_tokens[1:], dtype=np.int64)),
                        "weights": types.TensorData.from_numpy(weights)},
    )


def preference_datums(records, tokenizer, chat: bool = True) -> list[types.Datum]:
    """{prompt, chosen, rejected} records -> [chosen0, rejected0, chosen1, rejected1, ...]; a record's
    strength (workbench.recipes.preference_labels) rides on its chosen datum as its confidence."""
    from workbench.recipes.preference_labels import confidence

    data = []
    for record in records:
        for key in ("chosen", "rejected"):
            prompt_ids, full = encode_pair(record["prompt"], record[key], tokenizer, chat)
            data.append(completion_datum(prompt_ids, full))
        with_confidence(data[-2], confidence(record))
    return data


def with_confidence(chosen: types.Datum, p: float) -> types.Datum:
    """Mark a pair's chosen datum with the label's confidence p (in place; returned for chaining)."""
    if p != 1.0:
        # A raw array, as it has always been stored (the Datum exists: nothing coerces it): only dpo_loss reads it,
        # client-side (_confidence takes an array or a TensorData); the SDK types the dict's values as TensorData only.
        chosen.loss_fn_inputs["confidence"] = np.asarray([p], dtype=np.float32)  # type: ignore[assignment]
    return chosen


def add_reference_logprobs(data: list[types.Datum], reference) -> list[types.Datum]:
    """Copies of `data` carrying the reference model's target logprobs in loss_fn_inputs["ref_logprobs"].

    `reference` is a TrainingClient (its `forward`, e.g. before the first DPO step) or a
    SamplingClient (`compute_logprobs`, e.g. the base model's).
    """
    if hasattr(reference, "forward"):
        outputs = reference.forward(data, "cross_entropy").result().loss_fn_outputs
        ref = [out["logprobs"].to_numpy().astype(np.float32) for out in outputs]
    else:
        futures = []
        for datum in data:
            tokens = datum.model_input.to_ints() + [int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])]
            futures.append(reference.compute_logprobs(types.ModelInput.from_ints(tokens)))
        # compute_logprobs gives one logprob per position, None for the first token: drop it to
        # align with the targets (position i predicts token i + 1).
        ref = [np.asarray(f.result()[1:], dtype=np.float32) for f in futures]
    return [
        types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "ref_logprobs": r})
        for d, r in zip(data, ref)
    ]


def dpo_loss(data: list[types.Datum], logprobs_list: list[torch.Tensor], beta: float = 0.1):
    """The DPO loss over consecutive (chosen, rejected) datums; a `forward_backward_custom` loss.

    Returns (loss, metrics): dpo_loss, accuracy (share of pairs the policy already ranks right),
    margin (the mean implicit reward difference), chosen/rejected rewards. A pair's confidence p
    (loss_fn_inputs["confidence"] on its chosen datum) makes its label soft; see the module doc.
    """
    if len(data) % 2:
        raise ValueError("DPO data come in (chosen, rejected) pairs: an even number of datums")
    scores = []  # beta * (log pi - log ref) over the completion, per datum
    for datum, logprobs in zip(data, logprobs_list):
        weights = datum.loss_fn_inputs["weights"].to_torch().to(logprobs.dtype)
        policy = (logprobs * weights).sum()
        ref = datum.loss_fn_inputs.get("ref_logprobs")
        reference = (ref.to_torch().to(logprobs.dtype) * weights).sum() if ref is not None else 0.0
        scores.append(beta * (policy - reference))
    chosen, rejected = torch.stack(scores[0::2]), torch.stack(scores[1::2])
    margins = chosen - rejected
    p = torch.tensor([_confidence(d) for d in data[0::2]], dtype=margins.dtype)
    logsigmoid = torch.nn.functional.logsigmoid
    loss = -(p * logsigmoid(margins) + (1 - p) * logsigmoid(-margins)).mean()
    metrics = {
        "dpo_loss:mean": float(loss.detach()),
        "accuracy:mean": float((margins > 0).float().mean()),
        "margin:mean": float(margins.detach().mean()),
        "chosen_reward:mean": float(chosen.detach().mean()),
        "rejected_reward:mean": float(rejected.detach().mean()),
    }
    return loss, metrics


def _confidence(datum: types.Datum) -> float:
    p = datum.loss_fn_inputs.get("confidence")
    return 1.0 if p is None else float(np.asarray(p.to_numpy() if hasattr(p, "to_numpy") else p).reshape(-1)[0])


def make_dpo_loss(beta: float = 0.1):
    """dpo_loss with another beta, still a plain (data, logprobs_list) callable."""
    return functools.partial(dpo_loss, beta=beta)
