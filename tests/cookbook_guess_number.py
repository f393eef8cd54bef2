"""Run tinker-cookbook 0.5.8's own multi-turn recipe, `multiplayer_rl.guess_number`, against a Tinker-compatible server.

Run by the cookbook venv's python (tests/client_venvs.py), like tests/cookbook_rl.py, with whose command line and
offline set-up it shares tests/cookbook_common.py. The recipe is the cookbook's, unchanged: its CLIConfig and
build_config (tinker_cookbook/recipes/multiplayer_rl/guess_number/train.py) make the train.Config, and
`rl.train.main` runs it. An episode: the model guesses an integer in [0, 1024), the environment answers "Too low",
"Too high" or "Correct" as the next user turn, up to 10 turns; the cookbook sends one datum per turn, each holding
the conversation before it (the server computes their shared prefixes once: kernel_backend/engine/prefix_tree.py).

What this script sets is the recipe's own CLI options: the sizes (--batch-size, --group-size, --max-tokens),
max_steps, the log path, and eval_every (--eval-every, default 0: the recipe's test set is 103 numbers x 4
episodes x up to 10 turns, sampled before step 0 when eval_every > 0). The server is TINKER_BASE_URL, which
train.Config's base_url of None reads.

Usage:
    ~/.cache/stepwise/tinker-cookbook-<key>/bin/python tests/cookbook_guess_number.py --base-url http://127.0.0.1:8000 \\
        --api-key tml-local --tokenizer-dir ~/.cache/stepwise/models/HuggingFaceTB--SmolLM2-135M-Instruct \\
        --log-path /tmp/guess --steps 2

Exit status as tests/cookbook_common.py says; on success the last line printed is a JSON summary of metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from cookbook_common import EXIT_USAGE, add_common_args, check_common_args, fresh_log_path, read_metrics, run_as_script, setup

KEYS = {"reward": "env/all/reward/total", "turns_per_episode": "env/all/turns_per_episode",
        "ac_tokens_per_turn": "env/all/ac_tokens_per_turn", "ob_tokens_per_turn": "env/all/ob_tokens_per_turn",
        "kl_sample_train_v1": "optim/kl_sample_train_v1", "seconds": "time/total"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tinker-cookbook 0.5.8's guess_number recipe against a Tinker-compatible server.")
    add_common_args(p, steps=2, learning_rate=3e-5)
    p.add_argument("--batch-size", type=int, default=4, help="numbers to guess per step (default 4)")
    p.add_argument("--group-size", type=int, default=4, help="episodes per number (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per guess (default 16)")
    p.add_argument("--eval-every", type=int, default=0, help="the recipe's evaluation every N steps (default 0: none)")
    args = p.parse_args(argv)
    check_common_args(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (code := setup(args)) is not None:
        return code
    if args.self_check:
        return 0
    log_path = fresh_log_path(args.log_path)
    if log_path is None:
        return EXIT_USAGE
    os.environ["TINKER_BASE_URL"] = args.base_url

    import asyncio

    from tinker_cookbook.recipes.multiplayer_rl.guess_number import train as recipe
    from tinker_cookbook.rl import train

    cli = recipe.CLIConfig(model_name=args.model_name, renderer_name=args.renderer, group_size=args.group_size,
                           batch_size=args.batch_size, learning_rate=args.learning_rate, max_tokens=args.max_tokens,
                           eval_every=args.eval_every, max_steps=args.steps, log_path=str(log_path))
    asyncio.run(train.main(recipe.build_config(cli)))

    rows = read_metrics(log_path)
    summary = {"steps": [r.get("progress/batch") for r in rows], **{k: [r.get(v) for r in rows] for k, v in KEYS.items()}}
    print(json.dumps(summary), flush=True)
    if len(rows) != args.steps or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in summary["reward"]):
        print(f"error: expected {args.steps} metrics.jsonl rows with a finite {KEYS['reward']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_as_script(main)
