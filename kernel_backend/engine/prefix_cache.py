"""Recent prompts' keys and values, for later prompts that start the same way (prefix caching).

Requests often share the start of their prompt: a system prompt, a question sampled for a group,
a teacher scoring each of a group's answers with `compute_logprobs` (teacher prompt + answer, so
the prompt part recurs four times a group and the system prompt in every request). The decoder
stores each prompt's keys and values here once its prefill is done; a later request on the same
weights copies the keys and values of the longest prefix it shares with one of them and prefills
only the rest.

An entry belongs to one set of weights: its adapter (None: the base model) and that adapter's
version, the sum of its tensors' in-place version counters, which every optimizer step and
weight load moves. An entry whose adapter was freed or changed is never matched, and goes first.
An entry may also keep the prompt's logprobs (when its request computed them from the first
position), so a `compute_logprobs` that shares the prefix needs no logits there either.

Memory: at most `budget_tokens` cached positions (keys and values of every layer), least recently
used out first; a prompt that another one holds all of, but for a few last tokens, goes when that one comes.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

# Shorter shared prefixes are not worth a lookup's copies.
MIN_SHARED_TOKENS = 8


def weights_version(adapter) -> int | None:
    """Changes whenever the adapter's weights change in place; None when it cannot be told."""
    if adapter is None:
        return 0
    try:
        return sum(p._version for p in adapter.parameters())
    except RuntimeError:  # inference tensors keep no version counter
        return None


@dataclass
class Entry:
    adapter: weakref.ref | None
    version: int
    tokens: list[int]
    keys: torch.Tensor  # (layers, kv_heads, len(tokens), head_dim)
    values: torch.Tensor
    logprobs: list[float] | None  # logprob of tokens[i + 1] at position i, for every i; None if not computed

    def matches(self, adapter, version: int) -> bool:
        if (self.adapter is None) != (adapter is None) or self.version != version:
            return False
        return self.adapter is None or self.adapter() is adapter


def shared_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.tokens = 0
        self.hits = self.reused_tokens = 0  # for /admin/stats, tests and bench/sample.py
        self._next_key = 0

    def stats(self) -> dict:
        """What the operator sees (/admin/stats): entries, positions held, and reuse since the decoder began."""
        return {"entries": len(self.entries), "tokens": self.tokens, "budget_tokens": self.budget_tokens,
                "hits": self.hits, "reused_tokens": self.reused_tokens}

    def nbytes(self) -> int:
        return sum(entry.keys.nbytes + entry.values.nbytes for entry in list(self.entries.values()))

    def lookup(self, adapter, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` on these weights, and that length
        (0 and None when none shares MIN_SHARED_TOKENS)."""
        version = weights_version(adapter)
        if version is None:
            return None, 0
        best, best_length, best_key = None, 0, None
        for key, entry in self.entries.items():
            if entry.matches(adapter, version):
                length = shared_length(entry.tokens, prompt)
                if length > best_length:
                    best, best_length, best_key = entry, length, key
        if best_length < MIN_SHARED_TOKENS:
            return None, 0
        assert best_key is not None  # (best_length > 0: an entry shared it)
        self.entries.move_to_end(best_key)
        return best, best_length

    def store(self, adapter, version: int | None, tokens: list[int], keys: torch.Tensor, values: torch.Tensor,
              logprobs: list[float] | None) -> None:
        """Keep a finished prompt's keys and values (the tensors themselves: the caller lets go of them).

        `version` is the weights' version when the prompt's prefill began: a long prompt is
        prefilled over several steps, and if the weights moved in between (an optimizer step on a
        live training adapter), its keys mix two versions and are not kept.
        """
        if version is None or version != weights_version(adapter):
            return
        if len(tokens) < MIN_SHARED_TOKENS or len(tokens) > self.budget_tokens:
            return
        stale = [k for k, e in self.entries.items() if (e.adapter is not None and e.adapter() is None)
                 or (e.adapter is not None and e.adapter() is adapter and e.version != version)]
        for key in stale:
            self._evict(key)
        for key, entry in list(self.entries.items()):  # one prompt the start of the other: keep the longer
            if not entry.matches(adapter, version):
                continue
            shared = shared_length(entry.tokens, tokens)
            if shared == len(tokens):
                self.entries.move_to_end(key)
                return
            if len(entry.tokens) - shared < MIN_SHARED_TOKENS <= shared:
                # The new prompt holds all of this one but a tail too short to be worth a lookup: a multi-turn
                # episode's next prompt, where the chat template's generation header ("<|im_start|>assistant")
                # gave way to the reply and the next turn. Kept, such entries fill the cache (each turn of every
                # episode) and push out the ones the next turns need.
                self._evict(key)
        while self.entries and self.tokens + len(tokens) > self.budget_tokens:
            self._evict(next(iter(self.entries)))
        self.entries[self._next_key] = Entry(weakref.ref(adapter) if adapter is not None else None, version,
                                             list(tokens), keys, values, logprobs)
        self._next_key += 1
        self.tokens += len(tokens)

    def _evict(self, key: int) -> None:
        self.tokens -= len(self.entries.pop(key).tokens)
