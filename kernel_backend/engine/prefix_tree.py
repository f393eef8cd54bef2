"""Rows that begin alike, computed once: the token tree of a training micro-batch.

A causal model's activations at a token depend only on the tokens up to it, so rows that share a
prefix share its activations exactly. RL batches are full of such rows: the answers of a GRPO group
all follow one prompt, and the per-turn datums of an episode (tinker-cookbook's multi-turn recipes)
each hold the whole conversation before their turn, so every datum is the one before it plus a turn.
`Tree` lays a micro-batch's rows out as a trie of tokens: one node per distinct (routing key,
prefix), at the position of its token. The model runs once over the nodes; each row's logprobs are
read at the nodes of its own path, with its own targets, weights and advantages, so the loss and
every gradient are those of the rows computed apart (to float rounding: tests/test_engine.py).

Attention runs once per node too: a node's query is taken on the first leaf path that holds it (a row
whose path another row extends needs no path of its own: its tokens are all on the longer one), against
the keys of that path up to it (packed_forward.causal_within_paths). Rows of different adapters never share a
node (the routing key is the adapter): the same tokens under other LoRA weights have other activations.
"""

from __future__ import annotations

import numpy as np


# A micro-batch bounds its tokens, and its keys at this many per token: attention gathers each leaf path's
# keys and values and keeps them for the backward (2 x the kv heads' width, 384 floats a layer for
# SmolLM2-135M), where a token keeps its layer's activations (norms, q, attention out, the MLP's three: about
# 6,000 floats), some 16 times as many. Rows that share nothing have as many keys as tokens.
KEYS_PER_TOKEN = 16


class Tree:
    """Rows added one by one (`add`); `cost_with` prices a row before it is added, so a micro-batch can stop short."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # each node's token
        self.positions: list[int] = []  # each node's position in its rows (its depth)
        self.keys: list[object] = []  # each node's routing key (its rows' adapter)
        self.paths: list[np.ndarray] = []  # each row's nodes, in order
        self.key_slots = 0  # the leaf paths' lengths summed: the keys attention gathers
        self._child: dict[tuple, int] = {}  # (parent node, or the routing key at the root; token) -> node
        self._parents: set[int] = set()  # nodes with a child
        self._leaf_of: dict[int, int] = {}  # a childless node some row ends at -> the first such row

    def _walk(self, key, row: list[int]) -> list[int]:
        """The nodes of `row`'s path already in the tree (its longest prefix the tree has)."""
        path: list[int] = []
        parent: int | tuple = ("root", key)  # a node, or the routing key at the root
        for token in row:
            node = self._child.get((parent, token))
            if node is None:
                break
            path.append(node)
            parent = node
        return path

    def cost_with(self, key, row: list[int]) -> int:
        """The micro-batch's size once `row` is added: its tokens (nodes), or its keys / KEYS_PER_TOKEN if more."""
        known = self._walk(key, row)
        keys = self.key_slots + self._added_key_slots(known, row)
        return max(len(self.tokens) + len(row) - len(known), -(-keys // KEYS_PER_TOKEN))

    def _added_key_slots(self, known: list[int], row: list[int]) -> int:
        """What adding `row`, whose path the tree has up to `known`, adds to the leaf paths' lengths."""
        if len(known) == len(row):
            return 0  # on a path already there
        if known and known[-1] in self._leaf_of:
            return len(row) - len(known)  # lengthens that leaf's path
        return len(row)  # a path of its own

    def add(self, key, row: list[int]) -> None:
        path = self._walk(key, row)
        self.key_slots += self._added_key_slots(path, row)
        parent: int | tuple = path[-1] if path else ("root", key)
        for position in range(len(path), len(row)):
            node = self._child[(parent, row[position])] = len(self.tokens)
            self.tokens.append(row[position])
            self.positions.append(position)
            self.keys.append(key)
            if position:
                assert isinstance(parent, int)  # a node: the root's key is the parent of position 0 only
                self._parents.add(parent)
                self._leaf_of.pop(parent, None)
            path.append(node)
            parent = node
        if path[-1] not in self._parents:
            self._leaf_of.setdefault(path[-1], len(self.paths))
        self.paths.append(np.array(path, dtype=np.int64))

    def leaf_paths(self) -> list[np.ndarray]:
        """The paths attention runs over: one per leaf, in the order their rows came."""
        return [self.paths[row] for row in sorted(self._leaf_of.values())]
