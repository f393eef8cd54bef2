"""Notebook 08's RL step, end to end: the backend and the episode loop as they were when issue 54 was filed, against
today's, in float32 and with the sampler on bf16 copies of the base weights (STEPWISE_SAMPLE_DTYPE=bfloat16).

Each side is a backend process of its own and runs notebook 08's RL recipe (workbench/recipes/rl.py, a calculator
tool, 4 problems x 8 episodes a step, two turns of up to 40 tokens, calls held to the tool's schema, rank-8 LoRA from
two SFT steps on demonstrations; no held-out eval: the steps alone) for --steps steps, rounds alternating between the
sides, the same seeds every round:
- as filed:        the backend of commit a02bb8e (a git worktree; issue 54 was filed on it), and the episode loop
                   that played every episode's turn t before any turn t + 1 (today's loop with its wait for the
                   first finished turn made a wait for all, as bench/agent_rollouts.py does);
- today float32:   this checkout, float32 sampling (the default);
- today bf16:      this checkout, STEPWISE_SAMPLE_DTYPE=bfloat16.
Prints each side's seconds a step (the recipe's own steps: sampler snapshot, rollouts, forward_backward, optim_step)
and the rollouts' share of them (rl.play, timed),
their medians, the ratios to "as filed", and each side's kl_sampler (the recipe's mean of sampler - learner logprob,
kl_sample_train's k1) and reward.

    .venv/bin/python bench/agent_rl_step.py [--steps 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchenv import BASE, REPO, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np  # noqa: E402

from agent_rollouts import calc, lockstep  # noqa: E402
from guess_number import worktree  # noqa: E402

AS_FILED = "a02bb8e"  # the commit issue 54 was filed on (its first work, e473113, came next)
SIDES = {"as filed": (AS_FILED, "float32"), "today float32": (None, "float32"), "today bf16": (None, "bfloat16")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="RL steps a round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import tinker
    from tinker import types

    from servers import start_server
    from workbench.recipes import common, episodes, rl

    calculator = [episodes.Tool.of(calc)]

    class Multiply(rl.Task):  # notebook 08's task
        tools = calculator

        def problems(self, n, rng):
            return [rl.Problem(f"What is {a}*{b}?", str(a * b)) for a, b in rng.integers(11, 99, size=(n, 2))]

        def env(self, problem):
            return episodes.ToolEnv(problem.question, check=lambda text: float(problem.answer in text),
                                    tools=self.tools, strict=True)

    task = Multiply()
    tokenizer = common.local_tokenizer()

    def demonstration(problem):  # notebook 08's warm-up: call, reply, plain answer
        asked = {"id": "call_0", "type": "function",
                 "function": {"name": "calc", "arguments": json.dumps({"expression": problem.question[8:-1]})}}
        return [{"role": "user", "content": problem.question}, {"role": "assistant", "content": "", "tool_calls": [asked]},
                *episodes.call_tools(calculator, [asked]), {"role": "assistant", "content": f"The answer is {problem.answer}."}]

    demos = [common.chat_datum(tokenizer, demonstration(p), tools=[t.schema for t in calculator])
             for p in task.problems(16, np.random.default_rng(123))]

    print(f"{time.strftime('%Y-%m-%d %H:%M')} {load_line()}; {args.steps} RL steps a round, {args.rounds} rounds", flush=True)
    servers, trees, warm = {}, [], {}
    try:
        for name, (commit, sample_dtype) in SIDES.items():
            repo = REPO
            if commit:
                repo = worktree(commit)
                trees.append(repo)
            home = Path(tempfile.mkdtemp(prefix="stepwise-bench-rl-step-"))
            (home / "models").symlink_to(Path.home() / ".cache" / "stepwise" / "models")
            servers[name] = start_server(home, env={"STEPWISE_SAMPLE_DTYPE": sample_dtype}, timeout=300, repo=repo)
            client = tinker.ServiceClient(base_url=servers[name].base_url, api_key=servers[name].api_key)
            tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
            for _ in range(2):
                tc.forward_backward(demos, "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
            warm[name] = (client, tc.save_state("warm").result().path)

        step_s: dict[str, list[float]] = {name: [] for name in SIDES}
        rows: dict[str, list[dict]] = {name: [] for name in SIDES}
        finished = episodes._finished
        rollout_s: dict[str, list[float]] = {name: [] for name in SIDES}  # each step's rollouts (rl.play)
        playing: list[float] = []  # the current run's, in step order
        play = rl.play

        def timed_play(*args, **kwargs):
            start = time.perf_counter()
            try:
                return play(*args, **kwargs)
            finally:
                playing.append(time.perf_counter() - start)
        rl.play = timed_play
        for r in range(args.rounds + 1):  # round 0 warms up (prefix caches, grammar compiles)
            for name in SIDES if r % 2 == 0 else reversed(list(SIDES)):
                client, path = warm[name]
                config = rl.Config(task=task, load_checkpoint_path=path, steps=args.steps, groups_per_batch=4,
                                   group_size=8, max_tokens=40, max_turns=2, max_episode_tokens=512,
                                   constrain_tool_calls=True, learning_rate=5e-4, eval_prompts=0, monitor_prompts=0,
                                   seed=r, progress=False, verbose=False,
                                   metrics_path=str(Path(tempfile.mkdtemp(prefix="stepwise-bench-rl-")) / "rl.jsonl"))
                marks = [time.perf_counter()]
                playing.clear()
                logged: list[dict] = []

                def on_step(row, marks=marks, logged=logged):
                    marks.append(time.perf_counter())
                    logged.append(row)
                episodes._finished = lockstep if name == "as filed" else finished
                try:
                    # the first mark is taken before the run's set-up (its training client): each step is timed from
                    # the one before it, the first from the recipe's start
                    rl.run(config, service_client=client, on_step=on_step)
                finally:
                    episodes._finished = finished
                seconds = np.diff(marks).tolist()
                print(f"round {r}{' (warm-up)' if r == 0 else ''} {name:<14} steps {', '.join(f'{s:.1f}' for s in seconds)} s "
                      f"(rollouts {', '.join(f'{s:.1f}' for s in playing)} s); "
                      f"reward {np.mean([row['reward'] for row in logged]):.2f}, sampled tokens "
                      f"{sum(row['sample_tokens'] for row in logged)}, kl_sampler "
                      f"{np.mean([row.get('kl_sampler', np.nan) for row in logged]):+.2e}, |gap| mean "
                      f"{np.mean([row.get('logprob_gap_mean', np.nan) for row in logged]):.1e}; {load_line()}", flush=True)
                if r:
                    step_s[name] += seconds
                    rollout_s[name] += playing
                    rows[name] += logged
        medians = {name: statistics.median(s) for name, s in step_s.items()}
        print("\nmedian seconds a step (of them rollouts): " + ", ".join(
            f"{name} {m:.1f} ({statistics.median(rollout_s[name]):.1f})" for name, m in medians.items()))
        for name in list(SIDES)[1:]:
            kl = np.mean([row.get("kl_sampler", np.nan) for row in rows[name]])
            gap = np.mean([row.get("logprob_gap_mean", np.nan) for row in rows[name]])
            print(f"  as filed / {name}: {medians['as filed'] / medians[name]:.2f}x; kl_sampler {kl:+.2e}, "
                  f"|sampler - learner| mean {gap:.1e}")
        kl = np.mean([row.get("kl_sampler", np.nan) for row in rows["as filed"]])
        print(f"  as filed's kl_sampler {kl:+.2e}   ({load_line()})")
    finally:
        for server in servers.values():
            server.stop()
        for tree in trees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


if __name__ == "__main__":
    main()
