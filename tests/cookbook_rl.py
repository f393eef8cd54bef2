"""Run tinker-cookbook 0.5.8's RL training against a Tinker-compatible server.

The RL twin of tests/cookbook_sft.py, and like it run by the *cookbook* virtual environment's
python (its own venv, tests/client_venvs.py: `python tests/client_venvs.py build tinker-cookbook`), never by the
project's main venv: tinker-cookbook 0.5.8 pins transformers<=5.5.4. The command line, the
offline set-up (the server's tokenizer folder registered with
`tinker_cookbook.tokenizer_utils.register_tokenizer`) and the exit codes come from
tests/cookbook_common.py, which both scripts import.

The task is made here, with a reward checked in code and no data set to download: "Answer with
one word that contains the letter x" (and z, v, k in turn). A sample earns 1 when the first word
of its answer contains the letter, minus 0.1 (the cookbook's `format_coef`) unless it is a single
word ended by the renderer's stop token. SmolLM2-135M-Instruct sampled at temperature 1 gets it
right about half the time for "x", so the groups have rewards that differ and the advantages are
not all zero. Each batch is --groups `ProblemGroupBuilder`s (one letter each) of --group-size
`ProblemEnv`s, from a `LetterWordDatasetBuilder` (an `RLDatasetBuilder`), rendered with the
`qwen3_instruct` renderer and a system message (token-for-token SmolLM2's chat template).

It runs `tinker_cookbook.rl.train.main` (the synchronous on-policy loop, `do_sync_training`)
for --steps steps with `save_every=--save-every` (default 1). The cookbook writes `metrics.jsonl`
(one line per step, with `env/all/reward/total`, `optim/kl_sample_train_v1`, ...) and
`checkpoints.jsonl` into --log-path: with save_every=1, one record per step named 000001 ...
(state_path and sampler_path) and one named "final".

Usage:
    ~/.cache/stepwise/tinker-cookbook-<key>/bin/python tests/cookbook_rl.py --base-url http://127.0.0.1:8000 \\
        --api-key tml-test --tokenizer-dir ~/.cache/stepwise/models/HuggingFaceTB--SmolLM2-135M-Instruct \\
        --log-path /tmp/rl-run --steps 12

    ~/.cache/stepwise/tinker-cookbook-<key>/bin/python tests/cookbook_rl.py --self-check --tokenizer-dir DIR   # no server

Exit status: 0 when train.main returned and metrics.jsonl has --steps rows with a finite mean
reward (the last line printed is a JSON summary: steps, rewards, checkpoints); 1 on any failure
(traceback on stderr); 2 on bad arguments or a --log-path holding an earlier run; 3 when nothing
listens at --base-url.

Every HTTP call is made by the tinker 0.38.0 SDK on behalf of rl.train: client/config,
client/dynamic_config, create_session, create_model, get_info; then, before the first step,
save_weights_for_sampler with no path (save_weights_and_get_sampling_client: an ephemeral
sampler) and create_sampling_session; each step asynchronous_sample (one request per
trajectory: --groups x --group-size, num_samples=1), forward_backward (importance_sampling loss,
protobuf), optim_step, and, with save_every=1, save_weights (save_state) and
save_weights_for_sampler named after the step, followed by create_sampling_session for that
checkpoint's sampler_path, which the next step samples from; at the end save_weights and
save_weights_for_sampler named "final"; retrieve_future for each result, and in runs longer than
10 s session_heartbeat and telemetry. train.main never closes its ServiceClient, so
sessions/{id}/finish is not called: the session (and what the server holds for it) stays until
its heartbeats stop and it expires.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from cookbook_common import (
    EXIT_USAGE,
    SYSTEM_PROMPT,
    add_common_args,
    chat_template_ids,
    check_common_args,
    fresh_log_path,
    read_jsonl,
    read_metrics,
    run_as_script,
    setup,
)

# Letters whose words SmolLM2-135M-Instruct finds some of the time (not always, not never).
LETTERS = "xzvk"
REWARD_KEY = "env/all/reward/total"


def question(letter: str) -> str:
    return f"Answer with one word that contains the letter {letter}."


def first_word(text: str) -> str:
    words = re.findall(r"[A-Za-z]+", text)
    return words[0] if words else ""


def is_correct(text: str, letter: str) -> bool:
    return letter in first_word(text).lower()


def is_one_word(text: str) -> bool:
    return len(text.split()) == 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="tinker-cookbook 0.5.8 rl.train smoke run against a Tinker-compatible server."
    )
    add_common_args(p, steps=12, learning_rate=1e-4)
    p.add_argument("--groups", type=int, default=2, help="environment groups (problems) per batch (default 2)")
    p.add_argument("--group-size", type=int, default=4, help="samples per problem (default 4)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens sampled per answer (default 8)")
    p.add_argument("--save-every", type=int, default=1, help="checkpoint every N steps (default 1)")
    args = p.parse_args(argv)
    check_common_args(p, args)
    if args.groups < 1 or args.group_size < 2:
        p.error("need --groups >= 1 and --group-size >= 2 (advantages are centred within a group)")
    if args.max_tokens < 1 or args.save_every < 0:
        p.error("need --max-tokens >= 1 and --save-every >= 0")
    return args


def _cookbook_classes():
    """The env, dataset and builder classes; made on first use, since they subclass the cookbook's."""
    from collections.abc import Sequence
    from functools import partial

    import chz

    from tinker_cookbook import renderers
    from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
    from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    class LetterWordEnv(ProblemEnv):
        """One question, "a word containing <letter>"; reward from ProblemEnv.step."""

        def __init__(self, letter: str, renderer: renderers.Renderer):
            super().__init__(renderer, convo_prefix=[{"role": "system", "content": SYSTEM_PROMPT}])
            self.letter = letter

        def get_question(self) -> str:
            return question(self.letter)

        def check_answer(self, sample_str: str) -> bool:
            return is_correct(sample_str, self.letter)

        def check_format(self, sample_str: str) -> bool:
            return is_one_word(sample_str)

        def get_reference_answer(self) -> str:
            return f"a word containing {self.letter!r}"

    class LetterWordDataset(RLDataset):
        def __init__(self, renderer: renderers.Renderer, groups: int, group_size: int, n_batches: int):
            self.renderer, self.groups, self.group_size, self.n_batches = renderer, groups, group_size, n_batches

        def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
            return [
                ProblemGroupBuilder(
                    env_thunk=partial(LetterWordEnv, LETTERS[(index * self.groups + g) % len(LETTERS)], self.renderer),
                    num_envs=self.group_size,
                    dataset_name="letter_word",
                )
                for g in range(self.groups)
            ]

        def __len__(self) -> int:
            return self.n_batches

    @chz.chz
    class LetterWordDatasetBuilder(RLDatasetBuilder):
        model_name_for_tokenizer: str
        renderer_name: str
        groups: int
        group_size: int
        n_batches: int

        async def __call__(self) -> tuple[LetterWordDataset, None]:
            tokenizer = get_tokenizer(self.model_name_for_tokenizer)
            renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
            return LetterWordDataset(renderer, self.groups, self.group_size, self.n_batches), None

    return LetterWordEnv, LetterWordDatasetBuilder


def self_check(model_name: str, renderer_name: str) -> int:
    """Render one prompt with the cookbook, compare it with the HF chat template, and score
    canned answers through the env's own step (the reward the trainer will see)."""
    import asyncio

    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    LetterWordEnv, _ = _cookbook_classes()
    tok = get_tokenizer(model_name)  # the registered factory
    renderer = renderers.get_renderer(renderer_name, tok)
    env = LetterWordEnv("x", renderer)
    prompt, stop = asyncio.run(env.initial_observation())
    ids = [int(t) for t in prompt.to_ints()]
    ref = chat_template_ids(
        tok,
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question("x")}],
        add_generation_prompt=True,
    )
    (im_end,) = tok.convert_tokens_to_ids(["<|im_end|>"])

    def reward(answer: str, stopped: bool = True) -> float:
        action = tok.encode(answer, add_special_tokens=False) + ([im_end] if stopped else [])
        return asyncio.run(env.step(action)).reward

    rewards = {
        "xylophone": reward("Xylophone"),  # right, one word, stopped: 1.0
        "apple": reward("apple"),  # wrong: -0.0 (format fine)
        "box of toys": reward("box of toys"),  # right but not one word: 0.9
        "xylophone, unstopped": reward("Xylophone", stopped=False),  # no stop token: 0.9
    }
    report = {
        "tokenizer": type(tok).__name__,
        "prompt_tokens": len(ids),
        "matches_chat_template": ids == ref,
        "text": tok.decode(ids),
        "stop": stop,
        "rewards": rewards,
    }
    print(json.dumps(report))
    ok = ids == ref and stop == [im_end] and [round(r, 6) for r in rewards.values()] == [1.0, 0.0, 0.9, 0.9]
    if not ok:
        print("error: the prompt does not match the chat template, or the rewards are off", file=sys.stderr)
    return 0 if ok else 1


def summarize(log_path: Path) -> dict:
    rows = read_metrics(log_path)
    checkpoints = read_jsonl(log_path / "checkpoints.jsonl")

    def column(key: str) -> list:
        return [r.get(key) for r in rows]

    return {
        "log_path": str(log_path),
        "steps": column("progress/batch"),
        "reward": column(REWARD_KEY),
        "correct": column("env/all/correct"),
        "kl_sample_train_v1": column("optim/kl_sample_train_v1"),
        "tokens_per_step": column("env/all/ac_tokens_per_turn"),
        "seconds_per_step": column("time/total"),
        "checkpoints": [c.get("name") for c in checkpoints],
        "sampler_checkpoints": sum(str(c.get("sampler_path", "")).startswith("tinker://") for c in checkpoints),
        "state_checkpoints": sum(str(c.get("state_path", "")).startswith("tinker://") for c in checkpoints),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (code := setup(args)) is not None:
        return code
    if args.self_check:
        return self_check(args.model_name, args.renderer)
    log_path = fresh_log_path(args.log_path)
    if log_path is None:
        return EXIT_USAGE

    import asyncio

    from tinker_cookbook.rl import train

    _, LetterWordDatasetBuilder = _cookbook_classes()
    config = train.Config(
        log_path=str(log_path),
        model_name=args.model_name,
        recipe_name="stepwise_cookbook_rl_test",
        renderer_name=args.renderer,
        dataset_builder=LetterWordDatasetBuilder(
            model_name_for_tokenizer=args.model_name,
            renderer_name=args.renderer,
            groups=args.groups,
            group_size=args.group_size,
            n_batches=args.steps,
        ),
        learning_rate=args.learning_rate,
        max_tokens=args.max_tokens,
        max_steps=args.steps,
        lora_rank=args.lora_rank,
        base_url=args.base_url,
        save_every=args.save_every,
        # No evaluators, no rolling checkpoints, no W&B; the HTML/JSON rollout logs of one group
        # per step are cheap and show what the model answered.
        eval_every=0,
        rolling_save_every=0,
        num_groups_to_log=1,
        wandb_project=None,
    )

    asyncio.run(train.main(config))

    summary = summarize(log_path)
    print(json.dumps(summary), flush=True)
    rewards = summary["reward"]
    if len(rewards) != args.steps or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in rewards):
        print(f"error: expected {args.steps} metrics.jsonl rows with a finite {REWARD_KEY}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_as_script(main)
