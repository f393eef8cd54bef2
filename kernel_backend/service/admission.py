"""Admission: the one gate a request that does model work passes before it is queued.

Every request's cost is bounded here before any work starts, and the per-tenant limits are
counted here, when work is admitted (not when it finishes, so back-to-back requests cannot
slip past a limit while the first ones are still queued):

- sampling sizes: num_samples, max_tokens, prompt + max_tokens within the model's context, seeds
  that fit in 64 bits, and what a request asks besides its samples (SampleOptions.check: top-k
  widths, prompt_alt_tokens_k and target ids per position at most MAX_TOPK_LOGPROBS, so their cost
  is at most that many values per prompt or sampled token; prompt_logprobs_last_n within the
  prompt), all checked before a future is stored or a job queued;
- tokens per minute (STEPWISE_TOKENS_PER_MINUTE): a request's tokens are counted when it is
  admitted; sampling counts its upper bound (prompt + num_samples * max_tokens) and is settled to
  what it really produced when it finishes; a failed request counts nothing once it has failed;
- sessions alive at once (STEPWISE_MAX_SESSIONS_PER_TENANT);
- checkpoint storage kept (STEPWISE_MAX_STORED_MB_PER_TENANT), checked before each save;
- an adapter that could never be resident (larger than the tenant's share of an engine's adapter cache,
  or the whole cache). How many adapters a tenant has is never a limit: the adapter cache keeps what
  fits and evicts the least recently used (kernel_backend/engine/adapter_cache.py).

The service calls `Admission` from each method that queues work; a refusal raises `RateLimited`
(429, with Retry-After, for limits that free up with time) or `UserError` (400, for a request that
could never pass). The token window is kept in this process's memory: one process serves one device.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from sqlalchemy import func, select

from kernel_backend.engine import adapter_cache
from kernel_backend.engine.adapter_cache import TRAINING_COPIES
from kernel_backend.config import Settings
from kernel_backend.metering import Usage
from kernel_backend.persistence.database import CheckpointRow, SessionRow, Store
from kernel_backend.types import SampleOptions, SamplingParams, check_logit_adjustments, check_sample_size
from kernel_backend.errors import RateLimited, UserError

# Seeds are 64-bit, as torch.Generator takes them.
SEED_RANGE = (-(2**63), 2**64 - 1)
WINDOW_S = 60.0


def check_seed(seed, where: str = "seed") -> None:
    low, high = SEED_RANGE
    if seed is not None and not (isinstance(seed, int) and low <= seed <= high):
        raise UserError(f"{where} must be an integer that fits in 64 bits ({low} to {high}), got {seed!r}")


def check_sampling(prompt_tokens: int, num_samples, params: SamplingParams, max_context: int, max_sample_tokens: int,
                   options: SampleOptions | None = None, vocab_size: int = 1 << 31) -> Usage:
    """Bound a sampling request before it is queued; fills in a missing max_tokens. Returns the most work
    it can do (its prompt once, every sample at max_tokens), which is what admission and budgets count."""
    check_sample_size(prompt_tokens, num_samples, params, max_context, max_sample_tokens, options or SampleOptions())
    check_logit_adjustments(params, vocab_size)
    check_seed(params.seed, "sampling_params.seed")
    return Usage(prefill_tokens=prompt_tokens, sample_tokens=num_samples * params.max_tokens)


class Admission:
    def __init__(self, settings: Settings, store: Store, adapter_bytes: Callable[[str, dict], int]) -> None:
        """`adapter_bytes(base_model, lora_config)`: the bytes one adapter's weights take (one copy)."""
        self.settings = settings
        self.store = store
        self.adapter_bytes = adapter_bytes
        self._lock = threading.Lock()
        self._window: dict[str, deque[list]] = {}  # tenant -> [admitted at, tokens], oldest first
        self._entries: dict[str, list] = {}  # request id -> its window entry, until settled

    # ---- tokens per minute --------------------------------------------------------------------

    def tokens(self, tenant: str, request_id: str, tokens: int) -> None:
        """Count `tokens` of work for `tenant` now, or raise if that would pass the per-minute limit."""
        limit = self.settings.tokens_per_minute
        if not limit or not tokens:
            return
        if tokens > limit:
            raise UserError(f"this request is {tokens} tokens, more than the {limit} tokens per minute this server "
                            "allows a tenant; split it (fewer datums or samples, or a lower max_tokens)")
        with self._lock:
            window = self._window.setdefault(tenant, deque())
            moment = time.monotonic()
            while window and moment - window[0][0] > WINDOW_S:
                self._entries.pop(window.popleft()[2], None)
            used = sum(entry[1] for entry in window)
            if used + tokens > limit:
                # When enough of the window has aged out for this request to fit.
                freed, wait = used + tokens - limit, WINDOW_S
                for admitted, counted, _ in window:
                    freed -= counted
                    if freed <= 0:
                        wait = WINDOW_S - (moment - admitted)
                        break
                raise RateLimited(f"tenant {tenant!r} was admitted {used} tokens in the last minute; this request's "
                                  f"{tokens} would pass the limit of {limit} tokens per minute", max(1, int(wait + 0.999)))
            entry = [moment, tokens, request_id]
            window.append(entry)
            self._entries[request_id] = entry

    def settle(self, request_id: str, tokens: int) -> None:
        """A request finished: count what it really processed (0 if it failed) instead of its estimate."""
        with self._lock:
            entry = self._entries.pop(request_id, None)
            if entry is not None:
                entry[1] = tokens

    # ---- sessions and adapters ------------------------------------------------------------------

    def session(self, tenant: str) -> None:
        limit = self.settings.max_sessions_per_tenant
        if not limit:
            return
        alive = self.store.count(SessionRow, SessionRow.tenant == tenant, SessionRow.status == "active")
        if alive >= limit:
            raise RateLimited(f"tenant {tenant!r} has {alive} active sessions, the limit is {limit}; "
                              "close one (ServiceClient.close(), or let it expire)", 10)

    def adapter(self, tenant: str, base_model: str, lora_config: dict, training: bool) -> None:
        """Could this adapter (a training run, or a sampler of a checkpoint) ever be resident? Never refused for how
        many adapters the tenant has: an engine's adapter cache evicts to make room (engine/adapter_cache.py)."""
        new = self.adapter_bytes(base_model, lora_config) * (TRAINING_COPIES if training else 1)
        share = self.settings.max_adapter_mb_per_tenant << 20
        cache = adapter_cache.budget_bytes(self.settings.adapter_cache_mb, self.settings.device)
        full = lora_config["rank"] == 0
        what = ("a full fine-tuning run (rank 0: its own copy of every weight, with gradients and AdamW's two moments)"
                if full and training else "a full fine-tuning checkpoint's weights" if full else "this adapter")
        smaller = "train a LoRA adapter instead (rank 1 or more)" if full else "use a smaller LoRA rank"
        # Every setting that is too small is named at once: a user who raises one should not meet the next.
        short = [(f"the engine's whole adapter cache of {cache >> 20} MB", "STEPWISE_ADAPTER_CACHE_MB")] if new > cache else []
        if share and new > share:
            short.append((f"the {share >> 20} MB of adapter memory this server gives tenant {tenant!r}",
                          "STEPWISE_MAX_ADAPTER_MB_PER_TENANT"))
        if short:
            raise UserError(f"{what} needs about {new >> 20} MB, more than {' and '.join(limit for limit, _ in short)}: "
                            f"raise {' and '.join(name for _, name in short)} to at least {(new >> 20) + 1} (and "
                            f"restart the server), or {smaller}")

    # ---- checkpoint storage -------------------------------------------------------------------

    def storage(self, tenant: str) -> None:
        """Room to store one more checkpoint for `tenant` (STEPWISE_MAX_STORED_MB_PER_TENANT)? The 429 names the
        oldest checkpoints, since deleting some is the fix."""
        limit = self.settings.max_stored_mb_per_tenant << 20
        if not limit:
            return
        with self.store.session() as s:
            used, count = s.execute(select(func.coalesce(func.sum(CheckpointRow.size_bytes), 0), func.count())
                                    .where(CheckpointRow.tenant == tenant)).one()
            if used < limit:
                return
            oldest = s.execute(select(CheckpointRow.tinker_path).where(CheckpointRow.tenant == tenant)
                               .order_by(CheckpointRow.created_at).limit(3)).scalars().all()
        raise RateLimited(
            f"tenant {tenant!r} stores {used >> 20} MB in {count} checkpoints, the limit is {limit >> 20} MB; delete "
            "checkpoints you no longer need (RestClient.delete_checkpoint_from_tinker_path, or DELETE "
            f"/api/v1/training_runs/{{run}}/checkpoints/{{kind}}/{{name}}), oldest first: {', '.join(oldest)}", 60)
