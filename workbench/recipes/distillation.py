"""On-policy distillation: the student samples, a teacher scores every sampled token.

    from workbench.recipes import distillation
    summary = distillation.run(distillation.Config(base_url=..., api_key=...))

    python -m workbench.recipes.distillation [--steps 12 --teacher-system "..." ...]

The teacher is the base model behind a system prompt that the student never sees
(`teacher_system`); the student is a LoRA on the same base model, prompted without it. So the
student learns to behave as if it had been given the hidden instruction.

How it works, and why: docs/cookbook.md, "Inside the recipes", workbench/recipes/distillation.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tinker
from tinker import types

from workbench.recipes import common, estimates
from workbench.recipes.common import BaseConfig, Summary

PROMPTS = [
    "What is your favorite color?", "How are you today?", "What should I eat for dinner?", "Tell me about dogs.",
    "What is the weather like in spring?", "Can you recommend a book?", "What is a good hobby?",
    "How do I stay healthy?", "What is the capital of France?", "Tell me a fun fact.", "What do cats eat?",
    "How do I make friends?", "What is the sun?", "Why is water important?", "What is your name?",
    "How do I learn to swim?",
]


@dataclass
class Config(BaseConfig):
    teacher_system: str = "You are a pirate. Always talk like a pirate and say 'Arr!'"
    prompts_path: str | None = None  # JSONL of {"prompt": ...}; None: the built-in PROMPTS
    steps: int = 12
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    max_tokens: int = 24
    temperature: float = 1.0
    kl_coef: float = 1.0
    learning_rate: float = 1e-3
    lr_schedule: str = "constant"
    loss: str = "sampled"  # "sampled": the reverse-KL estimate on each sampled token; "topk": the teacher's top-k
    topk: int = 8  # with loss="topk": the teacher's tokens per position (at most 20)

    def __post_init__(self) -> None:
        if self.loss not in ("sampled", "topk"):
            raise ValueError(f"loss must be 'sampled' or 'topk', not {self.loss!r}")


@dataclass
class Batch:
    data: list[types.Datum] = field(default_factory=list)
    kl: list[np.ndarray] = field(default_factory=list)  # per sample: student_lp - teacher_lp per token
    soft_labels: list[np.ndarray] = field(default_factory=list)  # loss="topk", per datum: (N, k) teacher probabilities
    sample_tokens: int = 0
    samples: int = 0  # answers sampled
    example: dict | None = None


def teacher_prompt_of(tokenizer, prompt: str, config: Config) -> list[int]:
    """The student's prompt (the user turn alone) behind the hidden system prompt."""
    return common.user_prompt(tokenizer, prompt, system=config.teacher_system)


def distill_batch(student, teacher, tokenizer, prompts: list[str], config: Config, seed: int) -> Batch:
    futures = []
    for i, prompt in enumerate(prompts):
        student_prompt = common.user_prompt(tokenizer, prompt)
        params = types.SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, seed=seed * 1000 + i)
        futures.append((prompt, student_prompt, student.sample(types.ModelInput.from_ints(student_prompt),
                                                                config.samples_per_prompt, params)))
    scored, batch = [], Batch()
    for prompt, student_prompt, future in futures:
        teacher_prompt = teacher_prompt_of(tokenizer, prompt, config)
        for seq in future.result().sequences:
            batch.samples += 1
            if not seq.tokens:
                continue
            scored.append((prompt, student_prompt, seq, teacher_scores(teacher, teacher_prompt + list(seq.tokens),
                                                                         len(seq.tokens), config)))
    for prompt, student_prompt, seq, scores in scored:
        teacher_lp, teacher_top = scores()
        student_lp = np.asarray(seq.logprobs, dtype=np.float32)
        kl = student_lp - teacher_lp
        batch.kl.append(kl)
        batch.sample_tokens += len(seq.tokens)
        if config.loss == "topk":
            datum, probs = soft_label_datum(student_prompt, seq.tokens, teacher_top)
            batch.data.append(datum)
            batch.soft_labels.append(probs)
        else:
            batch.data.append(common.rollout_datum(student_prompt, seq.tokens, student_lp, -config.kl_coef * kl))
        if batch.example is None:
            batch.example = {"prompt": prompt, "answer": tokenizer.decode(seq.tokens, skip_special_tokens=True)}
    return batch


def teacher_scores(teacher, tokens: list[int], answer: int, config: Config):
    """The teacher's logprob of each of the last `answer` tokens and, with loss="topk", its top-k (ids,
    logprobs) at each of those positions: a function to call for them once the request is done."""
    if config.loss == "sampled":
        future = teacher.compute_logprobs(types.ModelInput.from_ints(tokens))
        return lambda: (np.asarray(future.result()[-answer:], dtype=np.float32), None)
    future = teacher.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=1),
                            include_prompt_logprobs=True, topk_prompt_logprobs=config.topk,
                            prompt_logprobs_last_n=answer)

    def scores():
        result = future.result()
        top = result.topk_prompt_logprobs[-answer:]
        ids = np.array([[token for token, _ in row] for row in top], dtype=np.int64)
        lps = np.array([[lp for _, lp in row] for row in top], dtype=np.float32)
        return np.asarray(result.prompt_logprobs[-answer:], dtype=np.float32), (ids, lps)
    return scores


def soft_label_datum(prompt: list[int], answer: list[int], teacher_top) -> tuple[types.Datum, np.ndarray]:
    """The student's datum over prompt + answer with the teacher's top-k ids as (N, k) targets at the answer's
    positions, and the teacher's probabilities renormalized over its k (0 at the prompt's positions, whose
    targets are the next token repeated: they carry no weight)."""
    ids, lps = teacher_top
    tokens = list(prompt) + list(answer)
    n, k, start = len(tokens) - 1, ids.shape[1], len(prompt) - 1
    targets = np.repeat(np.asarray(tokens[1:], dtype=np.int64)[:, None], k, axis=1)
    targets[start:] = ids
    probs = np.zeros((n, k), dtype=np.float32)
    probs[start:] = np.exp(lps - lps.max(1, keepdims=True))
    probs[start:] /= probs[start:].sum(1, keepdims=True)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(targets),
                                        "weights": types.TensorData.from_numpy((probs > 0).astype(np.float32))})
    return datum, probs


def soft_label_loss(soft_labels: list[np.ndarray]):
    """forward_backward_custom's loss: the cross-entropy of the teacher's top-k probabilities against the
    student's logprobs of those k tokens, summed over answer tokens; metric kl_topk, per answer token."""
    import torch

    def loss(data, logprobs_list):
        total, kl, tokens = 0.0, 0.0, 0
        for probs, lp in zip(soft_labels, logprobs_list, strict=True):
            p = torch.from_numpy(probs)
            total = total - (p * lp).sum()
            entropy = -(p * torch.log(p.clamp_min(1e-30))).sum()
            kl += float(-entropy - (p * lp.detach()).sum())
            tokens += int((p.sum(1) > 0).sum())
        return total, {"kl_topk": kl / max(tokens, 1)}
    return loss


def run(config: Config, service_client: tinker.ServiceClient | None = None, on_step=None) -> Summary:
    """Run the recipe; `on_step(row)` sees every metrics row as it is logged (see common.MetricsLog)."""
    service_client = common.service_client_for(config, service_client)
    start = common.session_usage(config, service_client)
    prompts = common.read_prompts(config.prompts_path, PROMPTS)
    rng = np.random.default_rng(config.seed)
    tc = common.training_client(service_client, config)
    tokenizer = tc.get_tokenizer()
    teacher = service_client.create_sampling_client(base_model=config.base_model).result()
    log = common.MetricsLog(common.metrics_path_for(config, "distillation"), on_step)
    history = []
    bar = common.progress_bar(config.steps, "distill", config.progress)
    try:
        for step in range(1, config.steps + 1):
            student = tc.save_weights_and_get_sampling_client().result()
            chosen = choose_prompts(prompts, config, rng)
            batch = distill_batch(student, teacher, tokenizer, chosen, config, seed=config.seed * 100_000 + step)
            kl = float(np.concatenate(batch.kl).mean()) if batch.kl else float("nan")
            lr = common.lr_at(step - 1, config.steps, config.learning_rate, config.lr_schedule)
            row = {"kl_teacher": kl, "sample_tokens": batch.sample_tokens, "samples": batch.samples, "lr": lr,
                   "example": batch.example}
            if batch.data:
                if config.loss == "topk":
                    fb = tc.forward_backward_custom(batch.data, soft_label_loss(batch.soft_labels))
                else:
                    fb = tc.forward_backward(batch.data, "importance_sampling")
                optim = tc.optim_step(common.adam(lr))
                metrics = fb.result().metrics
                row.update(loss=metrics["loss:sum"], train_tokens=sum(d.model_input.length for d in batch.data))
                if "kl_topk" in metrics:
                    row["kl_topk"] = metrics["kl_topk"]
                optim.result()
            history.append(kl)
            log.log(step, **row)
            bar.set_postfix(kl=f"{kl:.3f}")
            bar.update(1)
    finally:
        bar.close()
        log.close()
    sampler_path = tc.save_weights_for_sampler("distillation-final").result().path
    initial, final, window = common.before_after(history)  # first step (initial weights) vs last steps
    return common.summarize("distillation", config, service_client, tc, config.steps, "kl_teacher", initial, final,
                            log, compared=common.window_words(len(history), window), start=start,
                            sampler_path=sampler_path, extra={"kl_window": window},
                            progress_unit="0.1 kl_teacher drop", progress=(initial - final) / 0.1)


def choose_prompts(prompts: list[str], config: Config, rng: np.random.Generator) -> list[str]:
    """A step's prompts: prompts_per_step of them, drawn without replacement."""
    return [prompts[i] for i in rng.choice(len(prompts), size=min(config.prompts_per_step, len(prompts)), replace=False)]


def planned_tokens(config: Config, assume: estimates.Assumed) -> estimates.Tally:
    """The tokens run(config) sends, call by call, in its order (estimates.Tally): each step's prompts are
    drawn with run()'s seed, so every prompt is the run's own; each answer counts assume.answer(max_tokens)."""
    tokenizer = common.local_tokenizer(config.base_model)
    prompts = common.read_prompts(config.prompts_path, PROMPTS)
    rng = np.random.default_rng(config.seed)
    answer = assume.answer(config.max_tokens)
    tally = estimates.Tally()
    for _ in range(config.steps):
        data = []
        for prompt in choose_prompts(prompts, config, rng):
            student_prompt = len(common.user_prompt(tokenizer, prompt))
            tally.sample_request(student_prompt, config.samples_per_prompt, answer)  # the student's answers
            teacher_prompt = len(teacher_prompt_of(tokenizer, prompt, config))  # the teacher scores each answer
            tally.compute_logprobs(teacher_prompt + answer, times=config.samples_per_prompt)  # or its top-k: the same
            data += [estimates.datum_input(student_prompt, answer)] * config.samples_per_prompt
        if config.loss == "topk":
            tally.forward_backward_custom(data)  # a forward, then the backward of the soft-label loss
        else:
            tally.forward_backward(data)  # one importance_sampling step on every answer
    return tally


def estimate(config: Config, previous: str | None = None) -> estimates.Estimate:
    """The run's tokens by meter and cost, before it runs (estimates.Estimate). Prompts are exact; each
    sampled answer counts max_tokens (the upper bound) or, typically, the mean length a previous
    distillation run measured (`previous`, its metrics JSONL; default: the latest)."""
    return estimates.estimate_run("distillation", config, planned_tokens, previous)


if __name__ == "__main__":
    common.main(Config, run)
