"""Agent rollouts, each episode going on as soon as its turn is back, against all episodes in lockstep.

An agent RL step is mostly rollouts, and their decode steps (docs/performance.md, "Where an agent RL step's time
goes"). `episodes.run_episodes` used to play every episode's turn t together, then every turn t + 1: each turn waited
for its slowest episode while the finished ones' rows left the decode batch. Now each episode's next turn is sent as
soon as its own turn is back and its environment has stepped, so it joins the server's running batch. This script
plays notebook 08's shape of rollouts (a calculator tool, "What is a*b?", 4 problems x 8 episodes, two turns of up to
40 tokens, calls held to the tool's schema) against one backend process (the real default model, a LoRA sampler
after two SFT steps on demonstrations, so that the policy calls the tool and then answers), both ways, rounds
alternating, the same seeds each round: the lockstep baseline is the same function with its wait for finished turns
replaced by a wait for all of them (`episodes._finished`), which is what the lockstep loop did.

Prints each round's wall time per way, their medians and ratio, and how many episodes came out token for token the
same both ways (a row's float32 products can round differently in another batch, which can change a sampled token).

    .venv/bin/python bench/agent_rollouts.py [--rounds 3] [--sample-dtype float32]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchenv import BASE, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np  # noqa: E402


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression, such as 23*47."""
    return str(eval(expression, {"__builtins__": {}}))


def lockstep(pending: dict) -> list[int]:
    """The old way: every pending turn back before any episode goes on."""
    concurrent.futures.wait([future.future() for _, future in pending.values()])
    return sorted(pending)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample-dtype", default="float32", help="the server's STEPWISE_SAMPLE_DTYPE")
    args = parser.parse_args()

    import tinker
    from tinker import types

    from servers import start_server
    from workbench.recipes import episodes
    from workbench.client.connect import quiet_long_polls
    from workbench.recipes import common

    quiet_long_polls()  # the SDK's "Retrying request ... because of try_again": a long poll's normal end on 2 cores

    print(f"{time.strftime('%Y-%m-%d %H:%M')} {load_line()}")
    home = Path(tempfile.mkdtemp(prefix="stepwise-bench-agent-"))
    (home / "models").symlink_to(Path.home() / ".cache" / "stepwise" / "models")
    server = start_server(home, env={"STEPWISE_SAMPLE_DTYPE": args.sample_dtype}, timeout=300)
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        tokenizer = common.local_tokenizer()
        tools = [episodes.Tool.of(calc)]
        problems = [(f"What is {a}*{b}?", str(a * b)) for a, b in np.random.default_rng(0).integers(11, 99, size=(4, 2))]

        def demo(question: str, answer: str) -> list[dict]:  # notebook 08's warm-up: call, reply, plain answer
            call = {"id": "call_0", "type": "function",
                    "function": {"name": "calc", "arguments": json.dumps({"expression": question[8:-1]})}}
            return [{"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    *episodes.call_tools(tools, [call]), {"role": "assistant", "content": f"The answer is {answer}."}]
        demos = [common.chat_datum(tokenizer, demo(q, a), tools=[t.schema for t in tools]) for q, a in problems * 4]
        training = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
        for _ in range(2):
            training.forward_backward(demos, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=2e-3)).result()
        sampler = training.save_weights_and_get_sampling_client().result()

        def play(seed: int):
            envs = [episodes.ToolEnv(q, check=lambda text, a=a: float(a in text), tools=tools, strict=True)
                    for q, a in problems for _ in range(8)]
            start = time.perf_counter()
            played = episodes.run_episodes(sampler, tokenizer, envs, tools=tools, max_turns=2, max_tokens=40,
                                           max_episode_tokens=512, seed=seed, constrain_calls=True)
            return time.perf_counter() - start, played

        finished = episodes._finished
        times = {"lockstep": [], "as each turn is back": []}
        same = total = 0
        for r in range(args.rounds + 1):  # the first round warms up (prefix cache, grammar compile)
            results = {}
            for way in (times if r % 2 == 0 else reversed(list(times))):
                episodes._finished = lockstep if way == "lockstep" else finished
                try:
                    results[way] = play(seed=r)
                finally:
                    episodes._finished = finished
            old, new = results["lockstep"][1], results["as each turn is back"][1]
            same += sum(a.tokens == b.tokens for a, b in zip(old, new))
            total += len(old)
            line = ", ".join(f"{way} {seconds:.1f} s" for way, (seconds, _) in results.items())
            sampled = sum(e.policy_tokens for e in new)
            print(f"round {r}{' (warm-up)' if r == 0 else ''}: {line}; {sampled} sampled tokens, reward "
                  f"{np.mean([e.reward for e in new]):.2f}, {load_line()}", flush=True)
            if r:
                for way, (seconds, _) in results.items():
                    times[way].append(seconds)
        medians = {way: statistics.median(t) for way, t in times.items()}
        print("medians: " + ", ".join(f"{way} {m:.1f} s" for way, m in medians.items()) +
              f"; lockstep / as each turn is back = {medians['lockstep'] / medians['as each turn is back']:.2f}x; "
              f"{same} of {total} episodes token for token the same both ways")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
