"""What an RL step's rollouts say: triage, diversity, and the distance to the base model.

The measures the rl recipe logs each step (docs/cookbook.md, "Inside the recipes", rl.py): the
tinker cookbook's by-group counts, the answers' diversity, length and entropy; the KL to the base model from a
base sampler's compute_logprobs, as a measure on held-out probes (with the collapse and KL flags) and as the
leash's per-token penalty; and the sampler-vs-learner logprob gap on the trained tokens.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np
from tinker import types

from workbench.recipes import common

if TYPE_CHECKING:  # annotations only: rl.py imports this module
    from workbench.recipes.rl import Config, Group


def group_metrics(groups: list[Group]) -> dict[str, float]:
    """The tinker cookbook's by-group counts (a tied group is all good when its reward is at least
    0.5, else all bad), what was dropped, and the rollouts' diversity, length and entropy (the mean
    surprisal, -logprob, of the sampled tokens: an estimate of the policy's per-token entropy)."""
    n = len(groups)
    tied = [g for g in groups if g.tied]
    texts = [t.strip() for g in groups for t in g.texts]
    lengths = [len(s.tokens) for g in groups for s in g.sequences]
    logprobs = [x for g in groups for s in g.sequences for x in s.logprobs]
    return {"frac_mixed": (n - len(tied)) / n, "all_good": sum(g.rewards[0] >= 0.5 for g in tied) / n,
            "all_bad": sum(g.rewards[0] < 0.5 for g in tied) / n,
            "dropped_tied": sum(g.dropped == "tied" for g in groups),
            "dropped_filtered": sum(g.dropped == "filtered" for g in groups),
            "distinct_in_group": float(np.mean([len({t.strip() for t in g.texts}) / len(g.texts) for g in groups])),
            "distinct_in_batch": len(set(texts)) / len(texts),
            "completion_tokens": float(np.mean(lengths)), "entropy": float(-np.mean(logprobs)) if logprobs else 0.0}


def base_logprobs(base_sampler, groups: list[Group]) -> list[list[np.ndarray]]:
    """The base model's logprob of each sampled token, per group and answer, all asked at once
    (compute_logprobs: prefill only, metered on the session)."""
    futures = [[base_sampler.compute_logprobs(types.ModelInput.from_ints(g.prompt + list(s.tokens)))
                for s in g.sequences] for g in groups]
    return [[np.asarray(f.result()[len(g.prompt):], dtype=float) for f in fs] for g, fs in zip(groups, futures)]


def kl_to_base(groups: list[Group], base: list[list[np.ndarray]]) -> tuple[list[np.ndarray], float]:
    """Per answer, each sampled token's logprob under the policy minus under the base model, and the
    mean over all tokens: the estimate of KL(policy || base) per token (the cookbook's kl_policy_base)."""
    diffs = [np.asarray(s.logprobs, dtype=float) - b for g, bs in zip(groups, base) for s, b in zip(g.sequences, bs)]
    tokens = np.concatenate(diffs) if diffs else np.zeros(0)
    return diffs, float(tokens.mean()) if tokens.size else 0.0


def kl_penalty(diffs: list[np.ndarray], mean: float, coef: float) -> list[np.ndarray]:
    """The KL penalty as per-token advantages (the cookbook's incorporate_kl_penalty): coef x (the
    batch's mean difference - this token's). Tokens the policy likes more than the base does are
    pushed down, the rest up; centred, so it moves no group's mean advantage."""
    return [coef * (mean - d) for d in diffs]


def probe_metrics(probes: list[Group], base: list[list[np.ndarray]]) -> tuple[dict, int, str]:
    """The held-out probes' diversity and KL to the base, and the most common answer (count, text)."""
    answers = [t.strip() for g in probes for t in g.texts]
    common_answer, count = Counter(answers).most_common(1)[0]
    _, kl = kl_to_base(probes, base)
    shown = common_answer if common_answer else "(nothing but white space)"  # a policy can collapse onto "\n\n\n"
    return {"probe_distinct": len(set(answers)) / len(answers), "kl_policy_base": kl}, count, shown


def flags_for(metrics: dict, count: int, answer: str, n: int, config: Config) -> list[dict]:
    """The collapse and KL flags of a step, with the answers that show it."""
    flags = []
    if metrics["probe_distinct"] <= config.collapse_distinct:
        distinct = round(metrics["probe_distinct"] * n)
        detail = (f"{n} of {n} held-out answers identical: {answer!r}" if count == n else
                  f"{distinct} distinct of {n} held-out answers; {count} are {answer!r}")
        flags.append({"kind": "collapse", "detail": detail})
    if metrics["kl_policy_base"] > config.kl_alert:
        flags.append({"kind": "kl", "detail": f"KL to the base {past(metrics['kl_policy_base'], config.kl_alert)} "
                                              f"nats/token on the held-out answers (alert above {config.kl_alert:g}); "
                                              f"e.g. {answer!r}"})
    return flags


def past(value: float, limit: float) -> str:
    """`value` to two decimals, or to as many more as it takes to show it is past `limit` (1.004 above 1, not 1.00)."""
    digits = 2
    while round(value, digits) <= limit and digits < 6:
        digits += 1
    return f"{value:.{digits}f}"


def against_base(base, kept: list[Group], probes: list[Group], config: Config) -> tuple[dict, list | None]:
    """A step's measures against the base model, from one batch of its compute_logprobs: with the leash,
    the kept answers' KL and their per-token penalty; the probes' diversity, KL and flags."""
    leashed = kept if config.kl_penalty_coef else []
    base_lp = base_logprobs(base, leashed + probes) if base is not None and (leashed or probes) else []
    row: dict[str, Any] = {}
    penalty = None
    if leashed:
        diffs, row["kl_batch_base"] = kl_to_base(leashed, base_lp[:len(leashed)])
        penalty = kl_penalty(diffs, row["kl_batch_base"], config.kl_penalty_coef)
        row["kl_penalty_tokens"] = sum(len(g.prompt) + len(s.tokens) for g in leashed for s in g.sequences)
    if probes:
        probe_row, count, answer = probe_metrics(probes, base_lp[len(leashed):])
        row.update(probe_row, flags=flags_for(probe_row, count, answer, len(probes), config))
    return row, penalty


def sampler_vs_learner(data: list[types.Datum], outputs: list[dict], masks: list[np.ndarray]) -> dict[str, float]:
    """Over the tokens the policy sampled, d = sampler logprob - learner logprob: kl_sampler (mean d) and
    the sampler-vs-trainer gap (mean and max |d|)."""
    diffs = [
        common.as_numpy(datum.loss_fn_inputs["logprobs"])[mask] - common.as_numpy(out["logprobs"])[mask]
        for datum, out, mask in zip(data, outputs, masks)
    ]
    d = np.concatenate(diffs) if diffs else np.zeros(1)
    return {"kl_sampler": float(d.mean()), "logprob_gap_mean": float(np.abs(d).mean()),
            "logprob_gap_max": float(np.abs(d).max())}
