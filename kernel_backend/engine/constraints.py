"""Constrained decoding in the built-in sampler: a grammar (SampleOptions.grammar, written and checked by
kernel_backend/grammars.py) compiled for the engine's tokenizer, and the per-row masks that enforce it.

A constrained row owns a matcher (a copy of its request's compiled grammar). Before each draw, the tokens its
matcher allows mask the row's logits (the others become -inf), so every token drawn keeps the text inside the
grammar: end-of-sequence only where the grammar accepts, and the row stops once the grammar is complete
(engine/sampler.py). Rows with and without a grammar share the batch; only constrained rows are masked.
The logprobs returned stay the model's own: the mask changes which token is drawn, not the distribution the
drawn token's logprob is read from (so importance ratios against compute_logprobs compare like with like).

The engine is llguidance (bench/constrained_decoding.py measured it against xgrammar: both compile a JSON schema in
a few ms and mask in well under a decode step; llguidance needs no other package and names the schema features
it does not implement). Compiling is per distinct grammar, once: the compiled matchers of the most recently used
CACHE_SIZE grammars are kept, and each row starts from a copy (about a microsecond).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

from kernel_backend.errors import UserError

CACHE_SIZE = 64  # compiled grammars kept per engine (each a few hundred KB at most)


@dataclass(frozen=True)
class Compiled:
    """A grammar compiled for a tokenizer: its start state (rows decode with copies) and the compiler that masks."""

    matcher: llguidance.LLMatcher
    compiler: Compiler


class Compiler:
    """One tokenizer's compiled grammars, the CACHE_SIZE most recently used."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        try:
            # The grammar's end-of-sequence tokens are the engine's: the mask allows them where the grammar accepts.
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        except ValueError as e:  # a slow (Python) tokenizer
            raise UserError(f"constrained decoding needs a fast tokenizer, and this model's is not ({e})") from None
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, Compiled] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor()  # computes a step's masks on several threads
        self.compiles = 0  # how many grammars were compiled (tests check the cache)

    def compile(self, grammar: str) -> Compiled:
        """`grammar` compiled, once while it stays among the CACHE_SIZE most recently used. UserError if it does not
        compile for this tokenizer."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise UserError(f"the grammar cannot be enforced: {matcher.get_error().strip().splitlines()[0]}")
        compiled = Compiled(matcher, self)
        with self._lock:
            self.compiles += 1
            self._compiled[grammar] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def allowed(self, matchers: list[llguidance.LLMatcher], stop_ids: list[set[int]]) -> torch.Tensor:
        """(rows, vocab) booleans: the tokens each matcher allows next. Where its grammar accepts, the row's own stop
        tokens too (end-of-sequence, and stop token ids the request names), so a stop ends the row only there."""
        # One bit per token, 32 to an int32 (llguidance's layout); not llguidance.torch, whose import compiles.
        bitmask = np.zeros((len(matchers), (self.vocab_size + 31) // 32), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data,
                                               bitmask.shape[1] * 4, len(matchers))
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        allowed = torch.from_numpy(bits.astype(bool))
        for i, matcher in enumerate(matchers):
            # (A matcher that allows nothing, which only an engine error could cause, may stop rather than draw
            # from no token at all.)
            if (matcher.is_accepting() or not allowed[i].any()) and stop_ids[i]:
                allowed[i, sorted(stop_ids[i])] = True
        return allowed


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Advance a row's matcher by the token drawn for it; True when the grammar is complete (the row stops)."""
    if not matcher.consume_token(token):  # the mask allowed it, so this is a bug, never the model's doing
        raise RuntimeError(f"constrained decoding drew a token its grammar refuses: {matcher.get_error()}")
    return matcher.is_stopped()
