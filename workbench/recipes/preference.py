"""Preference tuning: two samples per prompt, a label, DPO through forward_backward_custom.

    from workbench.recipes import preference
    summary = preference.run(preference.Config(base_url=..., api_key=..., rule="shorter"))

    python -m workbench.recipes.preference [--steps 12 --rule keyword:sun --beta 0.1 ...]

How it works, and why: docs/cookbook.md, "Inside the recipes", workbench/recipes/preference.py.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import tinker
import torch
from tinker import types

from workbench.recipes.dpo import add_reference_logprobs, completion_datum, dpo_loss
from workbench.recipes import common, estimates
from workbench.recipes.common import BaseConfig, Summary

PROMPTS = [
    "Describe the ocean.", "What do you like about autumn?", "Tell me about cats.", "Why is the sky blue?",
    "Give me a tip for studying.", "What is a good breakfast?", "Describe a forest at night.",
    "How do birds fly?", "What makes a good friend?", "Tell me about the moon.", "Why do we sleep?",
    "Describe your favorite city.", "What is music?", "How do plants grow?", "Give me advice on cooking pasta.",
    "What is the best way to relax?", "Tell me about rain.", "What is a computer?", "Describe a sunny day.",
    "How do I make tea?", "What are stars?", "Tell me about dogs.", "Why do leaves change color?",
    "What is friendship?",
]


@dataclass
class Config(BaseConfig):
    prompts_path: str | None = None  # JSONL of {"prompt": ...}; None: the built-in PROMPTS
    num_prompts: int = 16
    instruction: str = " Answer in two sentences."  # appended to every prompt: answers short enough to read whole
    max_tokens: int = 128
    temperature: float = 0.8
    rule: str = "shorter"            # shorter | longer | keyword:WORD
    beta: float = 0.1
    steps: int = 12
    batch_pairs: int = 4             # pairs per forward_backward_custom
    learning_rate: float = 1e-3
    lr_schedule: str = "constant"


def label(rule: str, a: tuple[list[int], str], b: tuple[list[int], str]) -> int:
    """+1 if a is preferred, -1 if b is, 0 for a tie. a and b are (tokens, text)."""
    if rule in ("shorter", "longer"):
        sign = 1 if rule == "shorter" else -1
        key_a, key_b = (len(a[0]), len(a[1])), (len(b[0]), len(b[1]))
        return 0 if key_a == key_b else (sign if key_a < key_b else -sign)
    if rule.startswith("keyword:"):
        word = rule.split(":", 1)[1].lower()
        has_a, has_b = word in a[1].lower(), word in b[1].lower()
        return 0 if has_a == has_b else (1 if has_a else -1)
    raise ValueError(f"unknown rule {rule!r}: shorter, longer or keyword:WORD")


class SamplingSettings(Protocol):
    """What sampling candidates reads of a config: Config's fields, or live_preference.LiveConfig's."""

    instruction: str
    max_tokens: int
    temperature: float
    seed: int


def rendered_prompt(tokenizer, prompt: str, config: SamplingSettings) -> list[int]:
    """What the model is asked: the prompt with config.instruction, as a user turn."""
    return common.user_prompt(tokenizer, prompt + config.instruction)


def sample_candidates(sampler, tokenizer, prompts: list[str], config: SamplingSettings,
                      first: int = 0) -> list[dict]:
    """Two samples per prompt, unlabeled: [{id, prompt, prompt_tokens, completions, completion_tokens,
    completion_logprobs, truncated}].

    The records are the Labeler widget's items as they are (`id`, `prompt`, two `completions`). The
    prompt is what the model was asked (with config.instruction). The id names the prompt and its
    two answers, so a labels file from an earlier sampling never labels these answers. `first`
    numbers the prompts (ids and seeds) of a later call, as the live loop makes (live_preference.py).
    A prompt whose answers are empty or the same twice gives no candidate: nothing to choose."""
    rendered = [rendered_prompt(tokenizer, p, config) for p in prompts]
    prompts = [p + config.instruction for p in prompts]
    futures = [
        sampler.sample(types.ModelInput.from_ints(tokens), 2,
                       types.SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature,
                                            seed=config.seed * 1000 + i))
        for i, tokens in enumerate(rendered, first)
    ]
    candidates = []
    for i, (prompt, tokens, future) in enumerate(zip(prompts, rendered, futures), first):
        samples = future.result().sequences
        sequences = [list(s.tokens) for s in samples]
        if not all(sequences) or sequences[0] == sequences[1]:
            continue
        digest = hashlib.sha1(json.dumps([prompt, sequences]).encode()).hexdigest()[:8]
        candidates.append({"id": f"p{i}-{digest}", "prompt": prompt, "prompt_tokens": tokens,
                           "completion_tokens": sequences, "completion_logprobs": [list(s.logprobs or []) for s in samples],
                           "completions": [tokenizer.decode(t, skip_special_tokens=True) for t in sequences],
                           "truncated": [s.stop_reason == "length" for s in samples]})
    return candidates


def pair_of(candidate: dict, preferred: int) -> dict:
    """The DPO pair of a candidate whose completion number `preferred` (0 or 1) won."""
    return {"prompt": candidate["prompt"], "prompt_tokens": candidate["prompt_tokens"],
            "chosen_tokens": candidate["completion_tokens"][preferred], "chosen": candidate["completions"][preferred],
            "rejected_tokens": candidate["completion_tokens"][1 - preferred],
            "rejected": candidate["completions"][1 - preferred]}


def label_by_rule(candidates: list[dict], rule: str) -> list[dict]:
    """Scripted labels (tests, scripts): the DPO pairs the rule decides; ties are dropped."""
    pairs = []
    for c in candidates:
        verdict = label(rule, *zip(c["completion_tokens"], c["completions"]))
        if verdict:
            pairs.append(pair_of(c, 0 if verdict > 0 else 1))
    return pairs


def pairs_from_labels(candidates: list[dict], labels: list[dict]) -> list[dict]:
    """Human labels (the Labeler widget's records, or read_labels(path)) as DPO pairs: every A/B choice;
    ties, both-bad and skips carry no preference."""
    by_id = {c["id"]: c for c in candidates}
    return [pair_of(by_id[r["item_id"]], r["preferred"]) for r in labels
            if r.get("preferred") is not None and r["item_id"] in by_id]


def pair_datums(pairs: list[dict]) -> list[types.Datum]:
    """[chosen0, rejected0, chosen1, ...]: the sampled tokens themselves, weight 1 on the answer."""
    data = []
    for pair in pairs:
        for key in ("chosen_tokens", "rejected_tokens"):
            data.append(completion_datum(pair["prompt_tokens"], pair["prompt_tokens"] + list(pair[key])))
    return data


def answer_logprobs(data: list[types.Datum], logprobs_list) -> np.ndarray:
    """log pi(answer | prompt) per datum: logprobs summed over the weighted positions."""
    return np.array([float((common.as_numpy(lp) * common.as_numpy(d.loss_fn_inputs["weights"])).sum())
                     for d, lp in zip(data, logprobs_list)])


def make_loss(beta: float):
    """workbench.recipes.dpo.dpo_loss plus the raw logprob margin among its metrics."""

    def loss_fn(data, logprobs_list):
        loss, metrics = dpo_loss(data, logprobs_list, beta=beta)
        with torch.no_grad():
            lps = answer_logprobs(data, [lp.detach().numpy() for lp in logprobs_list])
        metrics["logprob_margin:mean"] = float(np.mean(lps[0::2] - lps[1::2]))
        return loss, metrics

    return loss_fn


def margin_of(training_client, data: list[types.Datum]) -> float:
    """The mean logprob margin of (chosen, rejected) datums under the current weights (forward only)."""
    plain = [types.Datum(model_input=d.model_input,  # the server takes only its loss's own inputs
                         loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")}) for d in data]
    out = training_client.forward(plain, "cross_entropy").result()
    lps = answer_logprobs(data, [o["logprobs"] for o in out.loss_fn_outputs])
    return float(np.mean(lps[0::2] - lps[1::2]))


NOTHING_LABELLED = "no preference pairs to train on: label some pairs (A or B) first"


def train_dpo(training_client, pairs: list[dict], config: Config, log: common.MetricsLog,
              **first_row) -> tuple[float, float]:
    """Reference logprobs, then config.steps DPO steps over `pairs`; returns the all-pairs logprob
    margin (before, after) training. `first_row`: more figures for the step-0 row (how the pairs were sampled)."""
    if not pairs:  # else the SDK's own "No data provided", from deep inside forward
        raise ValueError(NOTHING_LABELLED)
    data = add_reference_logprobs(pair_datums(pairs), training_client)  # forward at the initial weights
    ref = [common.as_numpy(d.loss_fn_inputs["ref_logprobs"]) for d in data]
    lps = answer_logprobs(data, ref)
    initial = float(np.mean(lps[0::2] - lps[1::2]))
    log.log(0, logprob_margin=initial, pairs=len(pairs), **first_row)
    rng = np.random.default_rng(config.seed)
    stream = common.batches(list(range(len(pairs))), config.batch_pairs, rng)
    loss_fn = make_loss(config.beta)
    bar = common.progress_bar(config.steps, "dpo", config.progress)
    try:
        for step in range(1, config.steps + 1):
            batch = [d for i in next(stream) for d in (data[2 * i], data[2 * i + 1])]
            lr = common.lr_at(step - 1, config.steps, config.learning_rate, config.lr_schedule)
            fb = training_client.forward_backward_custom(batch, loss_fn)
            optim = training_client.optim_step(common.adam(lr))
            out = fb.result()
            optim.result()
            m = out.metrics
            row = log.log(step, lr=lr, dpo_loss=m.get("dpo_loss:mean"), accuracy=m.get("accuracy:mean"),
                          reward_margin=m.get("margin:mean"), batch_logprob_margin=m.get("logprob_margin:mean"),
                          train_tokens=sum(d.model_input.length for d in batch))
            bar.set_postfix({"loss": f"{row['dpo_loss']:.3f}",
                             "batch margin before the step": f"{row['batch_logprob_margin']:.2f}"})
            bar.update(1)
    finally:
        bar.close()
    final = margin_of(training_client, data)
    log.log(config.steps, logprob_margin=final)
    return initial, final


def run(config: Config, service_client: tinker.ServiceClient | None = None, on_step=None) -> Summary:
    """Run the recipe; `on_step(row)` sees every metrics row as it is logged (see common.MetricsLog)."""
    service_client = common.service_client_for(config, service_client)
    start = common.session_usage(config, service_client)
    prompts = prompts_of(config)
    tc = common.training_client(service_client, config)
    tokenizer = tc.get_tokenizer()
    base = service_client.create_sampling_client(base_model=config.base_model).result()
    candidates = sample_candidates(base, tokenizer, prompts, config)
    pairs = label_by_rule(candidates, config.rule)
    if not pairs:
        raise RuntimeError(f"rule {config.rule!r} labeled no pair (every pair tied): try more prompts or another rule")
    log = common.MetricsLog(common.metrics_path_for(config, "preference"), on_step)
    try:  # how many prompts gave a pair, and the answers' length: for the next estimate (estimates.measured)
        initial, final = train_dpo(tc, pairs, config, log, prompts=len(prompts), samples=2 * len(candidates),
                                   sample_tokens=sum(len(t) for c in candidates for t in c["completion_tokens"]))
    finally:
        log.close()
    sampler_path = tc.save_weights_for_sampler("preference-final").result().path
    extra = {"pairs": len(pairs), "examples": [{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in pairs[:3]]}
    return common.summarize("preference", config, service_client, tc, config.steps, "logprob_margin", initial, final,
                            log, compared="every pair's chosen - rejected, before -> after training", start=start,
                            sampler_path=sampler_path, extra=extra,
                            progress_unit="label", progress=len(pairs))


def prompts_of(config: Config) -> list[str]:
    return common.read_prompts(config.prompts_path, PROMPTS)[: config.num_prompts]


# ---------------------------------------------------------------------------------------------
# The estimate: run() above, counting tokens instead of sending them


def planned_tokens(config: Config, assume: estimates.Assumed) -> estimates.Tally:
    """The tokens run(config) sends, call by call, in its order (estimates.Tally). Prompts are exact; each
    answer counts assume.answer(max_tokens) tokens, and a share assume.kept of the prompts gives a pair
    (a tie under the rule, or two identical answers, gives none)."""
    tokenizer = common.local_tokenizer(config.base_model)
    prompts = [len(rendered_prompt(tokenizer, p, config)) for p in prompts_of(config)]
    answer = assume.answer(config.max_tokens)
    tally = estimates.Tally()
    for prompt in prompts:  # sample_candidates: two answers to each prompt, from the base model
        tally.sample_request(prompt, 2, answer)
    paired = prompts[: max(1, round(assume.kept * len(prompts)))]
    data = [estimates.datum_input(prompt, answer) for prompt in paired for _ in ("chosen", "rejected")]
    tally.forward(data)  # add_reference_logprobs: one forward at the initial weights
    stream = common.batches(list(range(len(paired))), config.batch_pairs, np.random.default_rng(config.seed))
    for _ in range(config.steps):  # DPO: forward_backward_custom on each batch of pairs
        tally.forward_backward_custom([d for i in next(stream) for d in (data[2 * i], data[2 * i + 1])])
    tally.forward(data)  # margin_of: the all-pairs margin after training
    return tally


def kept_share(rows: list[dict]) -> float | None:
    """The share of prompts that gave a pair, from a run's step-0 row."""
    first = next((r for r in rows if r.get("prompts")), None)
    return first["pairs"] / first["prompts"] if first else None


def estimate(config: Config, previous: str | None = None) -> estimates.Estimate:
    """The run's tokens by meter and cost, before it runs (estimates.Estimate). Prompts are exact. Sampled
    answers: the upper bound counts max_tokens for each and a pair from every prompt; the typical figure
    takes the mean answer length and the share of prompts that gave a pair from a previous preference
    run (`previous`, its metrics JSONL; default: the latest). The answers' length counts many times over:
    each is sampled once, then forwarded and trained on at every step its pair is in a batch."""
    return estimates.estimate_run("preference", config, planned_tokens, previous, kept_share)


if __name__ == "__main__":
    common.main(Config, run)
