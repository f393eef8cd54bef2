"""Each RL step's rollouts on disk: the rl recipe writes them, the RolloutInspector reads them.

    log = RolloutLog(run_dir / "rollouts")
    log.write(step, groups)                  # groups: a list of dicts, one per prompt (below)
    log.steps()                              # [1, 2, ...] the steps kept
    log.read(step)                           # that step's groups
    log.samples(step)                        # one row per sampled answer (the inspector's table)
    log.prompt_history(prompt)               # one prompt's answers at every step it was asked

One file per step, `step-000012.jsonl`, one line per group: a prompt and the answers sampled to it.

    {"step": 12, "group": 0, "kind": "train" | "probe", "prompt": "...",
     "completions": ["...", ...], "rewards": [...], "advantages": [...], "parts": {"correct": [...]},
     "tokens": [[...], ...], "logprobs": [[...], ...], "tied": true, "dropped": "" | "tied" | "filtered"}

How it works, and why: docs/workbench.md, "Inside the workbench, module by module", workbench/recipes/rollout_log.py.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_GROUPS_PER_STEP = 64
MAX_MB = 64


class RolloutLog:
    def __init__(self, path: str | Path, max_groups_per_step: int = MAX_GROUPS_PER_STEP, max_mb: float = MAX_MB):
        self.path = Path(path)
        self.max_groups_per_step, self.max_bytes = max_groups_per_step, int(max_mb * 2**20)

    def file(self, step: int) -> Path:
        return self.path / f"step-{int(step):06d}.jsonl"

    # ---- writing ----------------------------------------------------------------------------------

    def write(self, step: int, groups: list[dict]) -> Path:
        """Write one step's groups (train groups first, up to the cap, then probes) and keep the run
        within its size budget."""
        self.path.mkdir(parents=True, exist_ok=True)
        train = [g for g in groups if g.get("kind", "train") == "train"]
        probes = [g for g in groups if g.get("kind", "train") != "train"]
        kept = train[: self.max_groups_per_step] + probes[: self.max_groups_per_step]
        target = self.file(step)
        partial = target.with_suffix(".partial")
        with open(partial, "w", encoding="utf-8") as f:
            for group in kept:
                f.write(json.dumps({"step": int(step), **group}) + "\n")
        partial.replace(target)  # a reader never sees half a step
        self._trim()
        return target

    def _trim(self) -> None:
        files = sorted(self.path.glob("step-*.jsonl"))
        sizes = {f: f.stat().st_size for f in files}
        total = sum(sizes.values())
        for f in files[1:-1]:  # the first step and the newest stay
            if total <= self.max_bytes:
                break
            total -= sizes[f]
            f.unlink(missing_ok=True)

    # ---- reading ----------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return sorted(int(f.stem.split("-")[1]) for f in self.path.glob("step-*.jsonl"))

    def describe(self) -> str:
        """The steps kept, as ranges: "1, 5-12"."""
        return _ranges(self.steps())

    def read(self, step: int) -> list[dict]:
        f = self.file(step)
        if not f.exists():
            raise KeyError(f"no rollouts for step {step} in {self.path}; steps kept: {self.describe()}")
        return [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]

    def samples(self, step: int, kind: str | None = None) -> list[dict]:
        """One row per answer of `step` (of groups of `kind`, "train" or "probe", or all): the group's
        facts, the answer, its reward, advantage and reward parts, and its tokens and logprobs."""
        return [row for group in self.read(step) if kind in (None, group.get("kind", "train"))
                for row in rows_of(group)]

    def prompt_history(self, prompt: str) -> list[dict]:
        """Every answer to `prompt` at every step kept, oldest first (a probe prompt is asked every step)."""
        return [row for step in self.steps() for group in self.read(step) if group["prompt"] == prompt
                for row in rows_of(group)]


def rows_of(group: dict) -> list[dict]:
    """A stored group as one row per answer (the RolloutInspector's table)."""
    n = len(group["completions"])
    advantages = group.get("advantages") or [None] * n
    parts = group.get("parts") or {}
    tokens, logprobs = group.get("tokens") or [None] * n, group.get("logprobs") or [None] * n
    roles = group.get("roles")
    step = {"step": group["step"]} if group.get("step") is not None else {}
    return [{**step, "group": group["group"], "kind": group.get("kind", "train"),
             "prompt": group["prompt"], "completion": completion, "reward": reward,
             **({"advantage": advantage} if advantage is not None else {}),
             **{name: values[i] for name, values in parts.items()},
             "tied": bool(group.get("tied")), "dropped": group.get("dropped", ""),
             "tokens": tokens[i], "logprobs": logprobs[i], **({"roles": roles[i]} if roles else {})}
            for i, (completion, reward, advantage) in enumerate(zip(group["completions"], group["rewards"], advantages))]


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7, 8] -> "1-3, 7-8" (an error message's list of kept steps)."""
    if not steps:
        return "none"
    out: list[str] = []
    start: int | None = steps[0]  # None once the last run is out
    for prev, cur in zip(steps, steps[1:] + [None]):
        if cur is None or cur != prev + 1:  # a run of consecutive steps ends at prev
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return ", ".join(out)
