"""The adapters one engine holds: a cache bounded by memory, never a quota.

An engine serves any number of adapters over its base model: training runs (LoRA weights, their
gradients and optimizer state), checkpoint samplers and in-memory snapshots of runs. Nothing bounds
how many exist. What is *resident* on the device is bounded in bytes, and the adapter used longest
ago makes room for a new one:

- a checkpoint's sampler is dropped: its next request loads it again from its checkpoint
  (ops.sample_request), the same files, so the same numbers;
- a training run or an in-memory snapshot is spilled: its tensors (weights, gradients, optimizer
  moments) go to a file on a CPU device, or to host memory from a GPU, and come back bit for bit on
  its next use. The Python objects stay where they are (an optimizer keys its state by its
  parameters, the cluster's all-reduce holds them); only their tensors' memory is given up.

Two bounds, both in bytes: the engine's (STEPWISE_ADAPTER_CACHE_MB) and each owner's, a tenant's
share of it (STEPWISE_MAX_ADAPTER_MB_PER_TENANT). A tenant over its share makes room from its own
adapters, so one tenant's loop cannot push out everyone else's; the engine's bound evicts by last
use alone. An adapter a decode request is using, or one the call at hand needs (`keep`), is never
evicted: when nothing else can go, the cache holds more than its bound for a while, and refuses
nothing.

The engine owns one AdapterCache (engine/core.py); it is not thread-safe, like the engine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from kernel_backend.runtime import pid_alive

# A training run holds its weights, their gradients and AdamW's two moments: four copies of the
# adapter. The cache and admission both count a run at that size from the start.
TRAINING_COPIES = 4


def budget_bytes(cache_mb: int, device: str) -> int:
    """STEPWISE_ADAPTER_CACHE_MB in bytes; 0 means a default: a tenth of a GPU's memory, 512 MiB on CPU (where the
    cache shares the machine's memory with everything else, and a dropped sampler loads again in milliseconds:
    docs/performance.md, "Memory")."""
    if cache_mb > 0:
        return cache_mb << 20
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).total_memory // 10
    return 512 << 20


@dataclass
class Entry:
    slot: Any  # the engine's _Slot (engine/core.py, which imports this module): .adapter (lora.Adapter), .optimizer (None for a sampler), .steps
    owner: str  # the tenant, for its share ("" when nobody in particular: tests, the engine's own checks)
    reloadable: bool  # a checkpoint's sampler: evicting drops it, the checkpoint brings it back
    nbytes: int  # what it takes while resident (a run counts TRAINING_COPIES from the start)
    spilled: Path | dict | None = None  # while not resident: its tensors' file, or host copies of them

    @property
    def resident(self) -> bool:
        return self.spilled is None


class AdapterCache:
    def __init__(self, budget: int, owner_budget: int, spill_root: Path, device: str,
                 in_use: Callable[[], set[int]] = set) -> None:
        """`in_use()`: ids (Python id()) of the lora.Adapter objects that decode requests are using now."""
        self.budget, self.owner_budget, self.device = budget, owner_budget, device
        self.in_use = in_use
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.counts = {"drops": 0, "spills": 0, "restores": 0, "over_budget": 0}
        self._spill_root = Path(spill_root)
        self._spill_dir: Path | None = None

    # ---- what callers use ---------------------------------------------------------------------

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self.entries

    def entry(self, adapter_id: str) -> Entry:
        """The entry, resident or not, without touching it (KeyError if unknown)."""
        return self.entries[adapter_id]

    def add(self, adapter_id: str, slot, owner: str = "", reloadable: bool = False, keep=()) -> None:
        """Hold a new adapter (replacing one of the same id), making room for it first."""
        self.drop(adapter_id)
        nbytes = sum(_nbytes(p) for p in slot.adapter.parameters()) * (TRAINING_COPIES if slot.optimizer else 1)
        self._make_room(nbytes, owner, {adapter_id, *keep})
        self.entries[adapter_id] = Entry(slot, owner, reloadable, nbytes)

    def get(self, adapter_id: str, keep=()):
        """The adapter's slot, resident: restored first if it was spilled (KeyError if unknown). Marks it used."""
        entry = self.entries[adapter_id]
        # Room for it if it comes back; if it is resident, the others back within the bounds (a bound that
        # was lowered, an adapter that was in use while others arrived).
        self._make_room(0 if entry.resident else entry.nbytes, entry.owner, {adapter_id, *keep})
        if not entry.resident:
            self._restore(entry)
        self.entries.move_to_end(adapter_id)
        return entry.slot

    def drop(self, adapter_id: str) -> None:
        entry = self.entries.pop(adapter_id, None)
        if entry is not None and isinstance(entry.spilled, Path):
            entry.spilled.unlink(missing_ok=True)

    def resident(self) -> dict:
        """adapter id -> slot, for the adapters on the device now."""
        return {adapter_id: e.slot for adapter_id, e in self.entries.items() if e.resident}

    def stats(self) -> dict:
        resident = [e for e in self.entries.values() if e.resident]
        return {"resident": len(resident), "resident_bytes": sum(e.nbytes for e in resident),
                "spilled": len(self.entries) - len(resident), "budget_bytes": self.budget,
                "owner_budget_bytes": self.owner_budget, **self.counts}

    # ---- eviction -----------------------------------------------------------------------------

    def _make_room(self, nbytes: int, owner: str, keep: set[str]) -> None:
        busy = self.in_use()

        def evictable(adapter_id: str, entry: Entry) -> bool:
            return entry.resident and adapter_id not in keep and id(entry.slot.adapter) not in busy

        def used(of: str | None) -> int:
            return sum(e.nbytes for e in self.entries.values() if e.resident and (of is None or e.owner == of))

        if owner and self.owner_budget:  # the owner's share first, from its own adapters
            while used(owner) + nbytes > self.owner_budget:
                victim = next((i for i, e in self.entries.items() if e.owner == owner and evictable(i, e)), None)
                if victim is None:
                    break
                self._evict(victim)
        while used(None) + nbytes > self.budget:
            victim = next((i for i, e in self.entries.items() if evictable(i, e)), None)
            if victim is None:
                self.counts["over_budget"] += 1  # everything left is in use: hold more for now, refuse nothing
                return
            self._evict(victim)

    def _evict(self, adapter_id: str) -> None:
        entry = self.entries[adapter_id]
        if entry.reloadable:
            self.drop(adapter_id)
            self.counts["drops"] += 1
            return
        tensors = _tensors(entry.slot)
        if self.device.startswith("cuda"):
            entry.spilled = {name: t.to("cpu", copy=True) for name, t in tensors.items()}
        else:
            path = self._spill_folder() / f"{len(self.entries)}-{os.urandom(6).hex()}.safetensors"
            save_file({name: t.contiguous() for name, t in tensors.items()}, path)
            entry.spilled = path
        _release(entry.slot)
        self.counts["spills"] += 1

    def _restore(self, entry: Entry) -> None:
        spilled = entry.spilled
        assert spilled is not None  # (restored only while spilled)
        if isinstance(spilled, Path):
            tensors = load_file(spilled)
            spilled.unlink(missing_ok=True)
        else:
            tensors = spilled
        _put_back(entry.slot, {name: t.to(self.device) for name, t in tensors.items()})
        entry.spilled = None
        self.counts["restores"] += 1

    def _spill_folder(self) -> Path:
        """This process's own folder under <home>/spill (folders of processes that are gone are removed)."""
        if self._spill_dir is None:
            self._spill_root.mkdir(parents=True, exist_ok=True)
            for old in self._spill_root.iterdir():
                pid = old.name.split("-", 1)[0]
                if pid.isdigit() and not pid_alive(int(pid)):
                    shutil.rmtree(old, ignore_errors=True)
            self._spill_dir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self._spill_root))
        return self._spill_dir


# ---- a slot's tensors, taken out and put back in place ---------------------------------------------


def _tensors(slot) -> dict[str, torch.Tensor]:
    """Every tensor a slot holds, by a name unique within it: weights, gradients, optimizer state."""
    out = {}
    state = slot.optimizer.state if slot.optimizer is not None else {}
    for name, p in slot.adapter.named_parameters():
        out[f"weight/{name}"] = p.detach()
        if p.grad is not None:
            out[f"grad/{name}"] = p.grad
        for key, value in state.get(p, {}).items():
            if torch.is_tensor(value):
                out[f"state/{name}/{key}"] = value
    return out


def _release(slot) -> None:
    """Give up a slot's tensors' memory; the parameter objects (and the optimizer's keys) stay."""
    state = slot.optimizer.state if slot.optimizer is not None else {}
    for p in slot.adapter.parameters():
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        p.grad = None
        for key, value in state.get(p, {}).items():
            if torch.is_tensor(value):
                state[p][key] = None


def _put_back(slot, tensors: dict[str, torch.Tensor]) -> None:
    state = slot.optimizer.state if slot.optimizer is not None else {}
    for name, p in slot.adapter.named_parameters():
        p.data = tensors[f"weight/{name}"]
        p.grad = tensors.get(f"grad/{name}")
        for key in state.get(p, {}):
            if f"state/{name}/{key}" in tensors:
                state[p][key] = tensors[f"state/{name}/{key}"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

