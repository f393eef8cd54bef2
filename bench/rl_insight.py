"""What watching an RL run costs: rl recipe steps with the collapse probes and the KL leash against plain steps.

Each step of the rl recipe (workbench/recipes/rl.py) can also answer `monitor_prompts` fixed held-out
prompts (sampled with the step's batch) and score them under the base model (compute_logprobs), and, with
`kl_penalty_coef`, score every kept answer under the base model too. This runs the same short recipe three
ways, in turns, against one local backend, the same seeds each time:

- plain: monitor_prompts=0, no leash (what the recipe did before);
- watched: monitor_prompts=8 (the default);
- leashed: monitor_prompts=8 and kl_penalty_coef=1.

and prints each one's median seconds per step and its ratio to plain (lower is better, 1.00 is free).
Every step also writes its rollouts to disk in all three.

    python bench/rl_insight.py [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import benchenv  # noqa: F401 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import argparse
import statistics
import tempfile


from tqdm import tqdm  # noqa: E402

import workbench  # noqa: E402
from workbench.recipes import rl  # noqa: E402

WAYS = {"plain": dict(monitor_prompts=0), "watched": dict(monitor_prompts=8),
        "leashed": dict(monitor_prompts=8, kl_penalty_coef=1.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    client = workbench.connect()
    per_step: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as folder, tqdm(total=args.rounds * len(WAYS), desc="runs") as bar:
        for round_ in range(args.rounds):
            for way, settings in WAYS.items():
                rows: list[dict] = []
                config = rl.Config(steps=args.steps, groups_per_batch=4, group_size=8, max_tokens=16, eval_prompts=0,
                                   progress=False, verbose=False, metrics_path=f"{folder}/{way}-{round_}.jsonl", **settings)
                rl.run(config, service_client=client, on_step=rows.append)
                times = [0.0] + [r["time"] for r in rows]
                per_step[way] += [b - a for a, b in zip(times[1:], times[2:])]  # the first step warms up
                bar.update(1)
    plain = statistics.median(per_step["plain"])
    print(f"\n{'':8} {'s/step':>8} {'ratio':>6}   ({args.steps} steps of 4 prompts x 8 answers, 16 tokens, {args.rounds} rounds)")
    for way, seconds in per_step.items():
        print(f"{way:8} {statistics.median(seconds):8.2f} {statistics.median(seconds) / plain:6.2f}")


if __name__ == "__main__":
    main()
