"""Chat SFT: teach the model a JSONL of conversations, training on the assistant's tokens only.

    from workbench.recipes import sft
    summary = sft.run(sft.Config(base_url=..., api_key=...))       # or run(config, service_client)

    python -m workbench.recipes.sft [--steps 24 --batch-size 8 --learning-rate 1e-3 ...]

Data: one {"messages": [...]} conversation per line. A record may carry "split": "eval" (held
out for the eval loss) and "expect": "word" (after training, a greedy answer to the record's
last user turn must contain it). The shipped data/made_up_facts.jsonl holds eight invented facts
(three phrasings of each question to train on, one more to evaluate) that the base model cannot
know, so whatever it answers afterwards it learned here.

Each step: forward_backward (cross_entropy, weights 1 on assistant tokens) on a batch, then
optim_step with the step's learning rate (linear or cosine decay, optional warmup). Every
`eval_every` steps: forward on the held-out split (no gradient), logged as eval_loss (mean NLL per
assistant token). Every `save_every` steps: save_state. At the end: sampler weights, greedy
samples on the held-out questions, and the summary (headline metric: eval_loss).

Measured with `python -m workbench.recipes.sft` (defaults, embedded backend, default model, 2 shared
CPU cores, 4 minutes): eval_loss 2.93 -> 0.013 over 24 steps (0.85 at step 6, 0.13 at step 12), and
8/8 held-out questions answered with the invented fact; 12,091 train tokens, $0.00032.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tinker
from tinker import types

from workbench.recipes import common, estimates
from workbench.recipes.common import BaseConfig, Summary


@dataclass
class Config(BaseConfig):
    data_path: str = str(common.DATA_DIR / "made_up_facts.jsonl")
    eval_path: str | None = None     # held-out conversations; None: the "split": "eval" records of
    eval_fraction: float = 0.2       # data_path, or this random share of it when none is marked
    train_on: str = "all_assistant"  # or "last_assistant"
    batch_size: int = 8
    steps: int = 24
    learning_rate: float = 1e-3
    lr_schedule: str = "linear"      # constant | linear | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    eval_every: int = 6
    save_every: int = 12             # save_state every N steps (0: never); names "<checkpoint_prefix>-<step>"
    checkpoint_prefix: str = "sft"
    sample_questions: int = 8        # greedy answers to this many held-out questions that have "expect"
    sample_max_tokens: int = 24


def load_splits(config: Config, rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    records = common.read_jsonl(config.data_path)
    if config.eval_path:
        return records, common.read_jsonl(config.eval_path)
    if any("split" in r for r in records):
        return [r for r in records if r.get("split", "train") != "eval"], [r for r in records if r.get("split") == "eval"]
    order = rng.permutation(len(records))
    n_eval = max(1, int(round(len(records) * config.eval_fraction))) if len(records) > 1 else 0
    return [records[i] for i in order[n_eval:]], [records[i] for i in order[:n_eval]]


def eval_loss(training_client, data: list[types.Datum]) -> float:
    """Mean NLL per weighted (assistant) token, forward only."""
    if not data:
        return float("nan")
    out = training_client.forward(data, "cross_entropy").result()
    total, count = common.weighted_nll(data, out.loss_fn_outputs)
    return total / max(count, 1.0)


def question_prompt(tokenizer, record: dict) -> list[int]:
    """The record's conversation up to its last assistant turn, ready for the assistant to answer."""
    messages = record["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return common.render_prompt(tokenizer, messages[:last])


def greedy_answers(sampling_client, tokenizer, records: list[dict], max_tokens: int) -> tuple[list[dict], int]:
    """Greedy answers to each record's conversation up to its last assistant turn, and their tokens in all."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampling_client.sample(types.ModelInput.from_ints(question_prompt(tokenizer, r)), 1, params)
               for r in records]
    answers, tokens = [], 0
    for record, future in zip(records, futures):
        sampled = future.result().sequences[0].tokens
        tokens += len(sampled)
        text = tokenizer.decode(sampled, skip_special_tokens=True).strip()
        expect = record.get("expect")
        answers.append({
            "question": next(m["content"] for m in reversed(record["messages"]) if m["role"] == "user"),
            "expect": expect, "answer": text,
            "correct": None if expect is None else expect.lower() in text.lower(),
        })
    return answers, tokens


def checked_records(config: Config, eval_records: list[dict]) -> list[dict]:
    """The held-out records whose greedy answer is checked at the end."""
    return [r for r in eval_records if r.get("expect")][: config.sample_questions]


def run(config: Config, service_client: tinker.ServiceClient | None = None, on_step=None) -> Summary:
    """Run the recipe; `on_step(row)` sees every metrics row as it is logged (see common.MetricsLog)."""
    service_client = common.service_client_for(config, service_client)
    start = common.session_usage(config, service_client)
    rng = np.random.default_rng(config.seed)
    tc = common.training_client(service_client, config)
    tokenizer = tc.get_tokenizer()
    train_records, eval_records = load_splits(config, rng)
    train_data = [common.chat_datum(tokenizer, r["messages"], config.train_on) for r in train_records]
    eval_data = [common.chat_datum(tokenizer, r["messages"], config.train_on) for r in eval_records]
    stream = common.batches(train_data, config.batch_size, rng)

    log = common.MetricsLog(common.metrics_path_for(config, "sft"), on_step)
    initial = eval_loss(tc, eval_data)
    log.log(0, eval_loss=initial)
    latest_eval, checkpoints = initial, []
    bar = common.progress_bar(config.steps, "sft", config.progress)
    try:
        for step in range(1, config.steps + 1):
            batch = next(stream)
            lr = common.lr_at(step - 1, config.steps, config.learning_rate, config.lr_schedule,
                              config.warmup_steps, config.min_lr_ratio)
            fb = tc.forward_backward(batch, "cross_entropy")
            optim = tc.optim_step(common.adam(lr))  # queued behind the forward_backward, in order
            out = fb.result()
            optim.result()
            _, weight = common.weighted_nll(batch, out.loss_fn_outputs)
            row = {
                "lr": lr,
                "train_loss": out.metrics["loss:sum"] / max(weight, 1.0),
                "train_tokens": sum(d.model_input.length for d in batch),
            }
            if step % config.eval_every == 0 or step == config.steps:
                latest_eval = row["eval_loss"] = eval_loss(tc, eval_data)
            if config.save_every and step % config.save_every == 0:
                path = tc.save_state(f"{config.checkpoint_prefix}-{step}").result().path
                checkpoints.append(path)
                row["checkpoint"] = path
            log.log(step, **row)
            bar.set_postfix(train_loss=f"{row['train_loss']:.3f}", eval_loss=f"{latest_eval:.3f}")
            bar.update(1)
        bar.close()
        sampler_path = tc.save_weights_for_sampler(f"{config.checkpoint_prefix}-final").result().path
        sampler = service_client.create_sampling_client(model_path=sampler_path).result()
        checked = checked_records(config, eval_records)
        answers, answer_tokens = greedy_answers(sampler, tokenizer, checked, config.sample_max_tokens) if checked else ([], 0)
        if answers:  # the answers' lengths, for the next estimate (estimates.measured)
            log.log(config.steps, samples=len(answers), sample_tokens=answer_tokens)
    finally:
        bar.close()
        log.close()

    extra: dict[str, Any] = {"samples": answers}
    if answers:
        extra["answer_accuracy"] = float(np.mean([a["correct"] for a in answers]))
    return common.summarize("sft", config, service_client, tc, config.steps, "eval_loss", initial, latest_eval, log,
                            compared="held-out, per token: before -> after training",
                            start=start, checkpoints=checkpoints, sampler_path=sampler_path, extra=extra,
                            progress_unit="0.1 eval_loss drop", progress=(initial - latest_eval) / 0.1)


def planned_tokens(config: Config, assume: estimates.Assumed) -> estimates.Tally:
    """The tokens run(config) sends, call by call, in its order (estimates.Tally). The data are read and
    batched exactly as run() does (the same seed), so only the greedy answers' length is assumed."""
    tokenizer = common.local_tokenizer(config.base_model)
    rng = np.random.default_rng(config.seed)
    train_records, eval_records = load_splits(config, rng)
    train = [common.chat_datum(tokenizer, r["messages"], config.train_on).model_input.length for r in train_records]
    evals = [common.chat_datum(tokenizer, r["messages"], config.train_on).model_input.length for r in eval_records]
    stream = common.batches(train, config.batch_size, rng)  # the same batches, as lengths
    tally = estimates.Tally()
    if evals:
        tally.forward(evals)  # the initial eval loss
    for step in range(1, config.steps + 1):
        tally.forward_backward(next(stream))
        if evals and (step % config.eval_every == 0 or step == config.steps):
            tally.forward(evals)
    for record in checked_records(config, eval_records):  # one greedy answer each, from the final weights
        tally.sample_request(len(question_prompt(tokenizer, record)), 1, assume.answer(config.sample_max_tokens))
    return tally


def estimate(config: Config, previous: str | None = None) -> estimates.Estimate:
    """The run's tokens by meter and cost, before it runs (estimates.Estimate). Everything but the greedy
    answers at the end is exact; those count sample_max_tokens each (the upper bound), or, typically,
    as long as the answers of a previous sft run (`previous`, a metrics JSONL; default: the latest)."""
    return estimates.estimate_run("sft", config, planned_tokens, previous)


if __name__ == "__main__":
    common.main(Config, run)
