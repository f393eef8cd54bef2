"""What computing shared prefixes once saves in forward_backward (kernel_backend/engine/prefix_tree.py).

Two batches of the shapes RL sends, on the default model (SmolLM2-135M) in this process, each timed
with prefix sharing on and off (Settings.share_prefixes) on the same Engine, alternating:
- a GRPO step: 4 prompts x 8 answers (48-token prompts, 10-token answers), importance_sampling;
- a multi-turn step as tinker-cookbook's multi-turn recipes send it (one datum per turn, each holding the
  whole conversation before its turn): 16 episodes of 6 turns, a 60-token system prompt, 14-token
  observations, 12-token replies;
- the same with each reply written back re-rendered (as tinker-cookbook's guess_number does: its env
  re-renders the guess in a role of its own), so each turn's datum branches off the conversation: 16 episodes
  of 10 turns, a 100-token prompt, 16-token replies, 18-token re-rendered replies, 15-token observations.
Prints the median seconds of each and the ratio off / on, and the tokens billed vs computed.

    .venv/bin/python bench/prefix_sharing.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchenv  # noqa: E402, F401 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np
from tqdm import tqdm


def rl_datum(tokens: list[int], trained_from: int, rng):
    from kernel_backend.types import Datum

    n = len(tokens) - 1
    advantages = np.where(np.arange(n) >= trained_from - 1, rng.normal(size=n), 0.0).astype(np.float32)
    return Datum(tokens[:-1], {"target_tokens": np.array(tokens[1:]), "advantages": advantages,
                              "logprobs": np.full(n, -1.5, dtype=np.float32)})


def grpo_batch(rng, vocab: int) -> list:
    data = []
    for _ in range(4):
        prompt = rng.integers(0, vocab, 48).tolist()
        data += [rl_datum(prompt + rng.integers(0, vocab, 10).tolist(), len(prompt), rng) for _ in range(8)]
    return data


def multi_turn_batch(rng, vocab: int) -> list:
    data = []
    for _ in range(16):
        history = rng.integers(0, vocab, 60).tolist()
        for _ in range(6):
            history += rng.integers(0, vocab, 14).tolist()  # the observation
            start = len(history)
            history += rng.integers(0, vocab, 12).tolist()  # the policy's reply
            data.append(rl_datum(list(history), start, rng))
    return data


def branching_batch(rng, vocab: int) -> list:
    data = []
    for _ in range(16):
        history = rng.integers(0, vocab, 100).tolist()
        for _ in range(10):
            reply = rng.integers(0, vocab, 16).tolist()  # the policy's reply, trained
            data.append(rl_datum(history + reply, len(history), rng))
            history += rng.integers(0, vocab, 18 + 15).tolist()  # the reply re-rendered, then the observation
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from kernel_backend.engine.core import Engine
    from kernel_backend.types import LoraConfig

    engine = Engine()
    engine.create_adapter("bench", LoraConfig(rank=32, seed=0))
    rng = np.random.default_rng(0)
    print(f"{torch.get_num_threads()} threads, micro_batch_tokens {engine.settings.micro_batch_tokens}")
    for name, data in (("GRPO step (4 x 8)", grpo_batch(rng, engine.vocab_size)),
                       ("multi-turn step (16 episodes x 6 turns, a datum per turn)", multi_turn_batch(rng, engine.vocab_size)),
                       ("branching multi-turn step (16 episodes x 10 turns, replies re-rendered)",
                        branching_batch(rng, engine.vocab_size))):
        seconds = {True: [], False: []}
        computed = {}
        for _ in tqdm(range(args.repeats), desc=name, leave=False):
            for share in (False, True):
                engine.settings.share_prefixes = share
                start = time.perf_counter()
                result = engine.forward_backward("bench", data, "importance_sampling")
                seconds[share].append(time.perf_counter() - start)
                computed[share] = result.computed_tokens
        engine.settings.share_prefixes = True
        off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
        sent = sum(len(d.tokens) for d in data)
        print(f"{name}: {len(data)} datums, {sent} tokens sent (billed), {computed[True]} computed shared")
        print(f"  sharing off {off:.2f} s, on {on:.2f} s: {off / on:.2f}x")


if __name__ == "__main__":
    main()
