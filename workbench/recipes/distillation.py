"""On-policy distillation: the student samples, a teacher scores every sampled token.

    from workbench.recipes import distillation
    summary = distillation.run(distillation.Config(base_url=..., api_key=...))

    python -m workbench.recipes.distillation [--steps 12 --teacher-system "..." ...]

The teacher is the base model behind a system prompt that the student never sees
(`teacher_system`); the student is a LoRA on the same base model, prompted without it. So the
student learns to behave as if it had been given the hidden instruction.

Each step:
1. save the student's weights for sampling; sample `samples_per_prompt` answers to each of
   `prompts_per_step` prompts (the student's prompt: the user turn only);
2. the teacher's logprob of every sampled token: a base-model sampling client's
   compute_logprobs on (teacher prompt + the student's answer);
3. per-token advantage = kl_coef * (teacher_logprob - student_logprob), i.e. minus the per-token
   reverse-KL estimate, and one importance_sampling forward_backward + optim_step.
Headline metric: kl_teacher, the mean over sampled tokens of student_logprob - teacher_logprob
(a Monte-Carlo estimate of the per-token reverse KL(student || teacher) on the student's own
samples), logged every step; it falls as the student takes on the teacher's behaviour.

Measured with `python -m workbench.recipes.distillation` (defaults: the pirate teacher, 12 steps of
4 prompts x 4 samples; embedded backend, 2 shared CPU cores, 13 minutes): kl_teacher 0.495 at the
first step -> 0.11 (mean of the last 3 steps); 29,007 tokens in the session (teacher scoring
included), $0.00061. Asked "How do I stay healthy?" without the system prompt, the student now
answers "A mightyful conundrum, no? I've heard tell of long days at sea swabgin' mammin'...".
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


@dataclass
class Batch:
    data: list[types.Datum] = field(default_factory=list)
    kl: list[np.ndarray] = field(default_factory=list)  # per sample: student_lp - teacher_lp per token
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
            teacher_lp = teacher.compute_logprobs(types.ModelInput.from_ints(teacher_prompt + list(seq.tokens)))
            scored.append((prompt, student_prompt, len(teacher_prompt), seq, teacher_lp))
    for prompt, student_prompt, n_teacher_prompt, seq, teacher_lp in scored:
        teacher_lp = np.asarray(teacher_lp.result()[n_teacher_prompt:], dtype=np.float32)
        student_lp = np.asarray(seq.logprobs, dtype=np.float32)
        kl = student_lp - teacher_lp
        batch.kl.append(kl)
        batch.sample_tokens += len(seq.tokens)
        batch.data.append(common.rollout_datum(student_prompt, seq.tokens, student_lp, -config.kl_coef * kl))
        if batch.example is None:
            batch.example = {"prompt": prompt, "answer": tokenizer.decode(seq.tokens, skip_special_tokens=True)}
    return batch


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
                fb = tc.forward_backward(batch.data, "importance_sampling")
                optim = tc.optim_step(common.adam(lr))
                row.update(loss=fb.result().metrics["loss:sum"],
                           train_tokens=sum(d.model_input.length for d in batch.data))
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
            tally.compute_logprobs(teacher_prompt + answer, times=config.samples_per_prompt)
            data += [estimates.datum_input(student_prompt, answer)] * config.samples_per_prompt
        tally.forward_backward(data)  # one importance_sampling step on every answer
    return tally


def estimate(config: Config, previous: str | None = None) -> estimates.Estimate:
    """The run's tokens by meter and cost, before it runs (estimates.Estimate). Prompts are exact; each
    sampled answer counts max_tokens (the upper bound) or, typically, the mean length a previous
    distillation run measured (`previous`, its metrics JSONL; default: the latest)."""
    return estimates.estimate_run("distillation", config, planned_tokens, previous)


if __name__ == "__main__":
    common.main(Config, run)
