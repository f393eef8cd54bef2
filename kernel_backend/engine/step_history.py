"""Every step is a place to go back to: each training run's state after its recent optim steps, in host memory.

A run's state after step k is its LoRA weights plus its optimizer's state (no gradients: a step
zeroes them). That is small next to the base model (SmolLM2-135M, rank 8: about 30 MB with AdamW's
two moments), so the engine keeps a copy after every step:

    step 0      the run's initial weights, kept for the run's life (a fork "from the start")
    the last STEPWISE_STEP_HISTORY steps (default 8) of each run, older ones dropped as new ones come
    and no more than STEPWISE_STEP_HISTORY_MB (default 512) for all runs of an engine together: past
    that, the oldest copies go first, whichever run they belong to (step 0 copies last).

Older steps are reachable where the run's recovery snapshots are, on disk (every STEPWISE_SNAPSHOT_EVERY
steps, the newest STEPWISE_SNAPSHOTS_KEPT of them: service/recovery.py). `write` turns a kept step into
a checkpoint folder in save_state's format (or the adapter alone, for a sampler), which is how a fork
(create_training_client_from_state_with_optimizer) or a sampler of that step gets it: see
service/past_steps.py. The copies live in host memory whatever the device, so they take nothing from the
adapter cache's device budget. A full fine-tuning run's state (engine/full_weights.py: the whole model and
two moments, 1.6 GB for SmolLM2-135M) is kept only when it fits the budget on its own; otherwise its past
steps are its recovery snapshots alone.
"""

from __future__ import annotations

import collections
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kernel_backend.engine import full_weights, lora, optimizers


@dataclass
class StepState:
    adapter: lora.Adapter | full_weights.FullWeights  # a detached copy on the CPU (a full run's: its whole weights)
    optimizer_state: dict[str, torch.Tensor]  # optimizers.state_tensors(): flat, float32, CPU
    optimizer_kind: str
    step: int
    order: int  # when it was recorded, for the engine-wide eviction

    @property
    def nbytes(self) -> int:
        tensors = [*self.adapter.parameters(), *self.optimizer_state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


# What save_state's folder holds besides the weights (a sampler's copy of a state leaves them out).
OPTIMIZER_FILES = ("optimizer.safetensors", "stepwise_state.json")


def write_weights(directory: Path, adapter, base) -> None:
    """A run's weights alone (what a sampler loads): a LoRA adapter in PEFT's format, a full run's weights as a
    Hugging Face model folder (engine/full_weights.py). `base`: the engine's base_models.BaseModel."""
    if adapter.full:
        adapter.save(directory, base.path)
    else:
        lora.save_peft(adapter, directory, base.name)


def write_state(directory: Path, adapter, optimizer_state: dict[str, torch.Tensor], optimizer_kind: str,
                steps: int, base) -> None:
    """save_state's folder: the weights (write_weights), the optimizer's tensors, and the facts to restore them."""
    write_weights(directory, adapter, base)
    optimizer_file, facts_file = OPTIMIZER_FILES
    save_file(optimizer_state, directory / optimizer_file)
    meta = {"steps": steps, "lora": asdict(adapter.config), "optimizer": optimizer_kind}
    (directory / facts_file).write_text(json.dumps(meta))


class StepHistory:
    """The kept states of every run of one engine (the engine's thread owns it, as it owns the engine)."""

    def __init__(self, per_run: int, budget_bytes: int) -> None:
        self.per_run = per_run
        self.budget_bytes = budget_bytes
        self.runs: dict[str, collections.OrderedDict[int, StepState]] = {}
        self._order = itertools.count()

    def nbytes(self) -> int:
        return sum(state.nbytes for states in list(self.runs.values()) for state in list(states.values()))

    def record(self, run_id: str, adapter: lora.Adapter | full_weights.FullWeights, optimizer, steps: int) -> None:
        """Keep the run's state as it is now, after `steps` optim steps (0: just created or loaded)."""
        if self.per_run <= 0:
            return
        moments = 2 if optimizer is not None else 0  # AdamW's two per parameter (Dimuon keeps one)
        if _nbytes(adapter) * (1 + moments) > self.budget_bytes:
            return  # a full run's state outgrows the whole budget: its steps are kept on disk only (snapshots)
        kept = self.runs.setdefault(run_id, collections.OrderedDict())
        kept[steps] = StepState(
            adapter=_cpu_copy(adapter),
            # state_tensors gives views of the live moments on a CPU (float32 already): copies, or later steps move them.
            optimizer_state={name: t.clone() for name, t in optimizers.state_tensors(
                optimizer, adapter.named_parameters()).items()} if optimizer else {},
            optimizer_kind=optimizers.kind_of(optimizer) if optimizer else "adamw",
            step=steps, order=next(self._order))
        kept.move_to_end(steps)
        # The start stays whatever the count: "fork from step 0" is the question asked most.
        later = [s for s in kept if s != min(kept)]
        for old in later[:max(0, len(later) - self.per_run)]:
            del kept[old]
        self._fit_budget()

    def _fit_budget(self) -> None:
        """Past the byte budget, drop the oldest copies of any run, each run's start last."""
        entries = [(step == min(kept), state.order, run_id, step)
                   for run_id, kept in self.runs.items() for step, state in kept.items()]
        total = sum(state.nbytes for kept in self.runs.values() for state in kept.values())
        for _, _, run_id, step in sorted(entries):
            if total <= self.budget_bytes:
                return
            total -= self.runs[run_id].pop(step).nbytes

    def get(self, run_id: str, step: int) -> StepState | None:
        kept = self.runs.get(run_id)
        return kept.get(step) if kept is not None else None

    def steps(self, run_id: str) -> list[int]:
        return sorted(self.runs.get(run_id, {}))

    def drop_from(self, run_id: str, step: int) -> None:
        """Forget the run's kept states at `step` and after (a load took the run back there)."""
        for later in [s for s in self.runs.get(run_id, {}) if s >= step]:
            del self.runs[run_id][later]

    def forget(self, run_id: str) -> None:
        self.runs.pop(run_id, None)


def _cpu_copy(adapter):
    return adapter.copy(device="cpu")


def _nbytes(adapter) -> int:
    return sum(p.numel() * p.element_size() for p in adapter.parameters())
