"""Generation: every sample request on a base model decodes in one shared, continuous batch.

A `Decoder` holds the requests of every session, adapter and prompt at once. Each `step()`:
1. drops cancelled requests;
2. prefills waiting prompts, up to `prefill_tokens` prompt tokens per step (a longer prompt is
   split over several steps), all of them packed into one forward pass;
3. runs one decode step: one forward over the newest token of every live row, each row routed to
   its own adapter by `lora.route`, as training rows are.
Rows of a full fine-tuning run (engine/full_weights.py) run on weights of their own, so each step's
prefill and decode run one forward pass per set of weights present (`lora.weights_key`): the base
model's (with every LoRA adapter) and each full run's. They share the one KV cache and its budget.
A prompt that starts like a recent one on the same weights prefills only what follows the shared
prefix, whose keys and values come from the prefix cache (engine/prefix_cache.py).
Rows join when their prompt's prefill is done and leave when they stop, so a new request starts
within a step or two, however long the generations already running. The `num_samples` rows of a
request share its prompt's prefill (one forward, its keys and values copied to each row).
What a request asks about its prompt (SampleOptions: prompt logprobs and top-k, target ids'
logprobs, alternative tokens) comes from the logits of that prefill, chunk by chunk, computed only
from the first prompt position it needs; top-k at sampled positions from each decode step's logits.

What every path keeps, exactly:
- each sampled token's logprob is the model's own, before temperature / top-k / top-p, and
  `compute_logprobs` (a prefill) computes the same numbers;
- each row draws from its own random stream, seeded from (request seed, row), so a seeded
  request samples the same tokens whatever else shares the batch;
- Tinker's stop rules: end-of-sequence by default, strings or token ids, `[]` never stops; the
  stop token is kept in the returned tokens;
- a row of a request with a grammar (SampleOptions.grammar) draws only tokens its grammar allows, its
  logits masked before the draw (engine/constraints.py), stops only where the grammar accepts and stops
  when it is complete; its logprobs are still the model's own, unmasked.

The forward pass is the packed one (engine/packed_forward.py: Llama's layer and the families that vary it,
calling the model's own modules). Tokens travel as one flat (tokens, hidden) batch, so rows of different
lengths need no padding: attention is the only step that knows which tokens belong together, and here it
reads each row's cache up to its own length.
Every forward pass here runs under `lora.sampling`: with STEPWISE_SAMPLE_DTYPE=bfloat16 the base products use
the layers' bf16 copies (engine/lora.py) and the KV cache and attention over it are bf16 too, so sampled and
`compute_logprobs` logprobs are the bf16 model's; with float32 (the default) there are no copies and everything above
is the trainer's computation, bit for bit.
Other architectures decode one request at a time with transformers' own forward (`SerialDecoder`,
also the baseline the benchmarks compare against: it is the loop every request went through before).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from kernel_backend.engine import constraints, families, full_weights, lora, prefix_cache, small_products
from kernel_backend.engine.packed_forward import flat_forward
from kernel_backend.types import SampledSequence, SampleOptions, SampleResult, SamplingParams
from kernel_backend.errors import Cancelled

# Architectures whose modules the batched forward below calls (engine/families.py: Llama's layer and its variants).
BATCHED_ARCHITECTURES = tuple(families.FAMILIES)


@dataclass
class SampleRequest:
    """One `sample` call, validated by the engine: `num_samples` continuations of one prompt."""

    adapter: lora.Adapter | full_weights.FullWeights | None  # (None: the base model)
    prompt: list[int]
    num_samples: int
    params: SamplingParams  # max_tokens is set
    stop_token_ids: set[int]
    stop_strings: list[str]
    options: SampleOptions = field(default_factory=SampleOptions)  # validated against the prompt
    # on_token(row, token, logprob), called as each token is chosen (streaming). If it raises,
    # this request fails; the others in the batch go on.
    on_token: Callable[[int, int, float], None] | None = None
    # Set from any thread; the decoder drops the request at its next step.
    cancel: threading.Event = field(default_factory=threading.Event)
    # Set when the request leaves the decoder: a result or an error, and its share of compute time.
    result: SampleResult | None = None
    error: Exception | None = None
    compute_s: float = 0.0
    # options.grammar compiled (engine/constraints.py): each row decodes with a copy of it.
    constraint: constraints.Compiled | None = None

    @property
    def kv_tokens(self) -> int:
        """The most cache entries its rows can need: what admission reserves."""
        return self.num_samples * (len(self.prompt) + self.params.max_tokens)


def cache_tokens(model: torch.nn.Module, megabytes: int) -> int:
    """How many cache entries (keys and values of one token of one row, every layer) fit in `megabytes`, in the
    dtype the decoder keeps them in (Decoder.cache_dtype: bf16 with bf16 sampling copies, twice the entries)."""
    config: Any = model.config  # a transformers config (torch types a module's attributes as Tensor | Module)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = (lora.sample_dtype(model) or model.dtype).itemsize
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * itemsize
    return megabytes * 2**20 // per_token


# ---- choosing tokens -------------------------------------------------------------------------


def adjust_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row's logits (vocab,) as that row samples from them, before temperature and the filters: logit_bias
    added, then the repetition penalty over the tokens of the prompt and the output (CTRL's, as transformers
    and vLLM apply it), then OpenAI's frequency and presence penalties over the output's. A new tensor."""
    out = logits.clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=out.device)
        out[ids] += torch.tensor(list(params.logit_bias.values()), dtype=out.dtype, device=out.device)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), device=out.device)
        picked = out[seen]
        out[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=out.device), minlength=out.shape[-1]).to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (nucleus) filtering; masked entries become -inf. A new tensor, or
    `logits` itself where nothing changes them (temperature 1 and no filter: x / 1 is x, bit for bit, and a decode
    step's division of 32 x 49,152 logits was a pass over 6 MB for nothing)."""
    if params.temperature != 1:
        logits = logits / params.temperature
    if params.min_p > 0:
        # Less likely than min_p x the most likely token: log p < log p_max + log min_p.
        floor = logits.max(-1, keepdim=True).values + math.log(params.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (always keep the first).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def row_generator(seed: int | None, row: int) -> torch.Generator:
    """Row `row`'s own random stream: fixed by (seed, row) alone, whatever else is decoding."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # from the OS's entropy; leaves torch's global generator alone
        return generator
    return generator.manual_seed((seed * 1_000_003 + row) % 2**63)


# Draws of the prompt's alternative tokens (prompt_alt_tokens_k) use their own stream, apart from every row's.
ALT_TOKENS_STREAM = -1


def choose(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `logits` (rows, vocab), row i drawing from generators[i].

    Inverse-CDF sampling: one uniform number per row and step, so a row's draws depend on its
    own stream only (torch.multinomial over a batch would share one generator between rows).
    """
    if params.temperature == 0:
        return logits.argmax(-1)
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(logits.device)
    return draw(filter_logits(logits, params), u[:, None]).squeeze(-1)


def draw(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens (rows, k) from softmax(logits) (rows, vocab), one per uniform number in u (rows, k)."""
    cdf = logits.softmax(-1).cumsum_(-1)  # in place: the same sums, one vocabulary-wide buffer fewer
    total = cdf[:, -1:]
    # Strictly below the total, so the pick is a token with non-zero probability.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_max(logits.shape[-1] - 1)


# ---- one request's progress ------------------------------------------------------------------


class _Active:
    """A request inside a decoder: its prompt's prefill (and what it asks about the prompt), then its
    rows' tokens and logprobs."""

    def __init__(self, request: SampleRequest, decode_text: Callable[[list[int]], str]) -> None:
        self.request = request
        self.decode_text = decode_text
        self.prefilled = 0  # prompt tokens whose keys and values are computed
        self.cached = 0  # of those, copied from the prefix cache
        self.weights_version: int | None = None  # the adapter's, when the prefill began (engine/prefix_cache.py)
        self.keys: torch.Tensor | None = None  # (layers, kv_heads, prompt, head_dim) during prefill
        self.values: torch.Tensor | None = None
        n, options, scored = request.num_samples, request.options, len(request.prompt) - 1
        # Prompt position p's logits predict prompt token p + 1. Logprobs and top-k: from position
        # `logprobs_from` on (the last n tokens' with prompt_logprobs_last_n); None before it.
        wants_logprobs = options.prompt_logprobs or options.topk_prompt_logprobs > 0
        self.logprobs_from = scored - (options.prompt_logprobs_last_n or scored) if wants_logprobs else scored
        self.prompt_logprobs: list[float | None] = [None] * scored
        self.topk_prompt: list[list[tuple[int, float]] | None] = [None] * scored
        targets = options.target_prompt_logprobs
        self.target_logprobs = np.zeros(len(targets.ids), dtype=np.float32) if targets is not None else None
        k = options.prompt_alt_tokens_k
        self.alt_tokens = np.zeros((scored, k), dtype=np.int64)
        self.alt_logprobs = np.zeros((scored, k), dtype=np.float32)
        self.alt_generator = row_generator(request.params.seed, ALT_TOKENS_STREAM) if k else None
        # The first position whose logits are needed: `scored` (the last one, to sample from) when
        # the request asks nothing about its prompt.
        first_target = targets.first_row if targets is not None else scored
        assert first_target is not None  # SampleOptions.check rejects targets that name no token id
        self.logits_from = min(self.logprobs_from, 0 if k else scored, first_target)
        self.generators = [row_generator(request.params.seed, i) for i in range(n)]
        self.matchers = [request.constraint.matcher.deep_copy() for _ in range(n)] if request.constraint else None
        self.sequences = [SampledSequence([], [], "length", [] if options.topk_sample_logprobs else None) for _ in range(n)]
        self.rows_left = n

    def score_prompt(self, logits: torch.Tensor, start: int) -> None:
        """What the request asks about its prompt, from the logits at positions start, start + 1, ...
        (chunks come in order; the prompt's last position, which predicts no prompt token, is skipped)."""
        prompt, options = self.request.prompt, self.request.options
        end = min(start + len(logits), len(prompt) - 1)
        if end <= start:
            return
        logprobs = logits[: end - start].float().log_softmax(-1)
        low = max(start, self.logprobs_from)
        if low < end:
            mine = logprobs[low - start :]
            following = torch.tensor(prompt[low + 1 : end + 1], device=logprobs.device)
            self.prompt_logprobs[low:end] = mine.gather(-1, following[:, None]).squeeze(-1).tolist()
            if options.topk_prompt_logprobs:
                top = torch.topk(mine, options.topk_prompt_logprobs, dim=-1)
                self.topk_prompt[low:end] = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        targets = options.target_prompt_logprobs
        if targets is not None:
            cells = np.flatnonzero((targets.rows >= start) & (targets.rows < end) & (targets.ids >= 0))
            if cells.size:
                rows = torch.from_numpy(targets.rows[cells] - start).to(logprobs.device)
                ids = torch.from_numpy(targets.ids[cells]).to(logprobs.device)
                target_logprobs = self.target_logprobs
                assert target_logprobs is not None  # made in __init__ for a request with targets
                target_logprobs[cells] = logprobs[rows, ids].cpu().numpy()
        k = options.prompt_alt_tokens_k
        if k:
            # k draws at the request's temperature (no top-k / top-p), each position's from this
            # request's own stream in position order, so however the prefill is chunked they are the same.
            temperature = self.request.params.temperature
            u = torch.rand((end - start, k), generator=self.alt_generator).to(logprobs.device)
            drawn = logprobs.argmax(-1, keepdim=True).expand(-1, k) if temperature == 0 else draw(logprobs / temperature, u)
            self.alt_tokens[start:end] = drawn.cpu().numpy()
            self.alt_logprobs[start:end] = logprobs.gather(-1, drawn).cpu().numpy()

    def take(self, row: int, token: int, logprob: float, top: list[tuple[int, float]] | None) -> bool:
        """Record row's next token; True while the row goes on. Raises what on_token raises."""
        request, seq = self.request, self.sequences[row]
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        if top is not None:
            assert seq.top_logprobs is not None  # both there when the request asks topk_sample_logprobs (_choose_for)
            seq.top_logprobs.append(top)
        if request.on_token is not None:
            request.on_token(row, token, logprob)
        stop_strings = request.stop_strings
        stopped = token in request.stop_token_ids
        if self.matchers is not None and not stopped:
            stopped = constraints.advance(self.matchers[row], token)  # the grammar is complete
        if stopped or (stop_strings and any(s in self.decode_text(seq.tokens) for s in stop_strings)):
            seq.stop_reason = "stop"
        elif len(seq.tokens) < request.params.max_tokens:
            return True
        self.rows_left -= 1
        return False

    def finish(self) -> None:
        options = self.request.options
        result = SampleResult(sequences=self.sequences, cached_prompt_tokens=self.cached)
        if options.prompt_logprobs:
            result.prompt_logprobs = [None, *self.prompt_logprobs]
        if options.topk_prompt_logprobs:
            result.topk_prompt_logprobs = [None, *self.topk_prompt]
        if options.target_prompt_logprobs is not None:
            result.targets, result.target_prompt_logprobs = options.target_prompt_logprobs, self.target_logprobs
        if options.prompt_alt_tokens_k:
            result.prompt_alt_tokens, result.prompt_alt_logprobs = self.alt_tokens, self.alt_logprobs
        self.request.result = result
        self.keys = self.values = None


def _choose_for(actives: list[_Active], rows: list[int],
                logits: torch.Tensor) -> tuple[list[int], list[float], list[list[tuple[int, float]] | None]]:
    """Tokens, model logprobs and top-k lists for rows (logits row i is actives[i]'s row rows[i]).

    Rows whose requests filter alike (temperature, top-k, top-p, min-p) draw in one call, each from its
    own random stream: every op works row by row, so a row's token does not depend on its company
    (one call over a step's rows is 1.4x faster than one per request: bench/sample.py's workload)."""
    log_total = torch.logsumexp(logits, -1, keepdim=True)
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
    by_filter: dict[tuple, list[int]] = {}
    by_topk: dict[int, list[int]] = {}
    sampled_from = logits  # the model's logits, but where a row's penalties or biases change its own
    for i, active in enumerate(actives):
        params = active.request.params
        by_filter.setdefault((params.temperature, params.top_k, params.top_p, params.min_p), []).append(i)
        if active.request.options.topk_sample_logprobs:
            by_topk.setdefault(active.request.options.topk_sample_logprobs, []).append(i)
        if params.adjusts_logits:
            sampled_from = logits.clone() if sampled_from is logits else sampled_from
            sampled_from[i] = adjust_logits(logits[i], params, active.request.prompt, active.sequences[rows[i]].tokens)
    grammars = [(i, active.matchers[rows[i]]) for i, active in enumerate(actives) if active.matchers is not None]
    if grammars:  # each grammar's allowed tokens, after the row's own adjustments and before its filters
        constrained = [i for i, _ in grammars]
        sampled_from = logits.clone() if sampled_from is logits else sampled_from
        index = torch.tensor(constrained, device=logits.device)
        constraint = actives[constrained[0]].request.constraint
        assert constraint is not None  # a row has matchers when its request has a grammar (_Active.__init__)
        allowed = constraint.compiler.allowed([matcher for _, matcher in grammars],
                                              [actives[i].request.stop_token_ids for i in constrained])
        sampled_from[index] = sampled_from[index].masked_fill(~allowed.to(logits.device), float("-inf"))
    for members in by_filter.values():
        index = torch.tensor(members, device=logits.device)
        generators = [actives[i].generators[rows[i]] for i in members]
        mine = sampled_from if len(members) == len(rows) else sampled_from[index]  # usually every row: no copy
        tokens[index] = choose(mine, actives[members[0]].request.params, generators)
    for k, members in by_topk.items():
        index = torch.tensor(members, device=logits.device)
        best = torch.topk(logits[index], k, dim=-1)
        values = best.values - log_total[index]
        for i, ids, lps in zip(members, best.indices.tolist(), values.tolist()):
            tops[i] = list(zip(ids, lps))
    # From the model's own logits, unmasked and unadjusted: the logprob reported is the model's, whatever a
    # grammar, a penalty or a filter did to the draw.
    chosen = logits.gather(-1, tokens[:, None]) - log_total
    return tokens.tolist(), chosen.squeeze(-1).tolist(), tops


# ---- the batched decoder ---------------------------------------------------------------------


class KVCache:
    """Keys and values of the decoding rows, (layers, rows, kv_heads, length, head_dim) each.

    Live rows are always rows [0, n): a row that leaves is replaced by the last one. Capacity
    grows on demand (doubling) within `budget_tokens` rows x length, and is freed when idle.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, budget_tokens: int) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device, self.budget_tokens = dtype, device, budget_tokens
        self.clear()

    def clear(self) -> None:
        layers, kv_heads, head_dim = self.shape
        self.keys = torch.empty(layers, 0, kv_heads, 0, head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.empty_like(self.keys)

    def ensure(self, rows: int, length: int, longest_needed: int) -> None:
        """Room for `rows` rows of `length` entries. Grows by doubling, but never past the longest
        length a live row may reach, nor (rows x length) past the budget; keeps rows [0, rows)."""
        have_rows, have_length = self.keys.shape[1], self.keys.shape[3]
        if rows <= have_rows and length <= have_length:
            return
        new_length = max(length, min(2 * have_length, longest_needed)) if length > have_length else have_length
        new_rows = max(rows, min(2 * have_rows if rows > have_rows else have_rows, self.budget_tokens // new_length))
        layers, kv_heads, head_dim = self.shape
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.zeros(layers, new_rows, kv_heads, new_length, head_dim, dtype=self.dtype, device=self.device)
            kept = min(old.shape[1], new_rows)
            new[:, :kept, :, : old.shape[3]] = old[:, :kept]
            setattr(self, name, new)

    def move(self, source: int, target: int) -> None:
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]


@dataclass
class _Row:
    active: _Active
    index: int  # which of its request's samples
    length: int  # cache entries written (the position of next_token)
    next_token: int


class Decoder:
    """The continuous batch for one base model (see the module docstring). One thread owns it."""

    def __init__(self, model: torch.nn.Module, decode_text: Callable[[list[int]], str], budget_tokens: int,
                 prefill_tokens: int = 512, max_rows: int = 256) -> None:
        lm: Any = model  # a transformers causal LM: torch types its attributes (config, device, lm_head...) loosely
        config = lm.config
        self.model, self.decode_text = lm, decode_text
        self.budget_tokens, self.prefill_tokens, self.max_rows = budget_tokens, prefill_tokens, max_rows
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = config.num_key_value_heads
        self.windows = families.sliding_windows(config)  # each layer's sliding window (None: all it has seen)
        self.softcap = families.attention_softcap(config)  # Gemma 2 caps attention scores
        # Keys and values are kept in the sampling copies' dtype where there are copies (bf16: STEPWISE_SAMPLE_DTYPE), so
        # that attention over them runs in it too: a decode step's attention reads the whole cache of every row, and
        # bf16 halves those bytes and takes the CPU's bf16 kernels (docs/performance.md). float32: the model's dtype.
        self.cache_dtype: torch.dtype = lora.sample_dtype(model) or lm.dtype
        self.cache = KVCache(config.num_hidden_layers, self.kv_heads, self.head_dim, self.cache_dtype, lm.device,
                             budget_tokens)
        # Finished prompts' keys and values, for later prompts that start the same way; an 8th of the budget: room
        # for every episode of a multi-turn batch (each keeps its latest prompt, which the next turn extends; the
        # cookbook's guess_number, 16 episodes of up to ~600 tokens, thrashed a 32nd).
        self.prefixes = prefix_cache.PrefixCache(budget_tokens // 8)
        self.waiting: list[_Active] = []  # admitted, prefill not finished (FIFO)
        self.rows: list[_Row] = []  # decoding, row i in cache row i
        self.peak_rows = 0  # the most rows one decode step has run, since the start

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return families.family_of(model.config) is not None

    def admit(self, request: SampleRequest) -> None:
        self.waiting.append(_Active(request, self.decode_text))

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.rows)

    def stats(self) -> dict:
        """For /admin/stats: rows decoding, requests waiting for their prefill, the prefix cache."""
        return {"decoder": "batched", "rows": len(self.rows), "peak_rows": self.peak_rows, "waiting": len(self.waiting),
                "prefix_cache": self.prefixes.stats()}

    def adapters(self) -> list:
        """The adapters of the requests in the batch, waiting or decoding (the adapter cache keeps them)."""
        return [a.request.adapter for a in self.waiting] + [r.active.request.adapter for r in self.rows]

    def prefill_room(self) -> int:
        """Prompt tokens worth admitting now: what the next step could prefill beyond those waiting."""
        return self.prefill_tokens - sum(len(a.request.prompt) - a.prefilled for a in self.waiting)

    def _reserved(self, actives) -> tuple[int, int]:
        rows = sum(a.request.num_samples for a in actives)
        longest = max((len(a.request.prompt) + a.request.params.max_tokens for a in actives), default=0)
        return rows, longest

    @torch.inference_mode()
    def step(self) -> list[SampleRequest]:
        """Prefill what fits, then one decode step for every live row. Returns the requests that left."""
        finished: list[SampleRequest] = []
        self._drop(lambda a: a.request.cancel.is_set(), Cancelled("the request was cancelled"), finished)
        segments = self._plan_prefill()
        with lora.sampling(self.model):
            if segments:
                self._prefill(segments, finished)
            if self.rows:
                self._decode(finished)
        if not self.rows:
            self.cache.clear()
        return finished

    # ---- prefill --------------------------------------------------------------------------

    def _plan_prefill(self) -> list[tuple[_Active, int, int]]:
        """This step's prompt chunks, (request, start, end): first come first served, within the
        prefill budget. A request starts only when every started request's rows, at their longest,
        fit the cache budget; until then it and those after it wait."""
        segments: list[tuple[_Active, int, int]] = []
        budget = self.prefill_tokens
        started = {id(r.active): r.active for r in self.rows}
        for active in self.waiting:
            if budget <= 0:
                break
            if active.prefilled == 0:
                rows, longest = self._reserved([*started.values(), active])
                if rows > self.max_rows or rows * longest > self.budget_tokens:
                    break
                adapter, prompt = active.request.adapter, active.request.prompt
                active.weights_version = prefix_cache.weights_version(adapter)
                entry, cached = self.prefixes.lookup(adapter, prompt)
                planned = max((prefix_cache.shared_length(other.request.prompt, prompt) for other, _, _ in segments
                               if other.request.adapter is adapter), default=0)
                if planned >= cached + prefix_cache.MIN_SHARED_TOKENS:
                    continue  # next step, from the prefix cache, once that request's prefill has stored it there
                shape = (self.cache.shape[0], self.kv_heads, len(prompt), self.head_dim)
                active.keys = torch.empty(shape, dtype=self.cache_dtype, device=self.model.device)
                active.values = torch.empty_like(active.keys)
                if entry is not None:
                    self._reuse_prefix(active, entry, cached)
            started[id(active)] = active
            end = min(len(active.request.prompt), active.prefilled + budget)
            segments.append((active, active.prefilled, end))
            budget -= end - active.prefilled
        segments.sort(key=lambda segment: _adapter_key(segment[0]))  # each adapter's tokens side by side
        return segments

    def _reuse_prefix(self, active: _Active, entry: prefix_cache.Entry, shared: int) -> None:
        """Start a request's prefill after the `shared` prompt tokens a cached prompt (same weights)
        begins with: their keys and values are copied, and logprobs the request wants there too."""
        request = active.request
        start = min(shared, len(request.prompt) - 1)  # the last prompt position is always computed: rows sample from it
        if active.logits_from < start:  # the request wants logits before `start`: cached logprobs, or compute them
            options = request.options
            only_logprobs = not (options.topk_prompt_logprobs or options.prompt_alt_tokens_k
                                 or options.target_prompt_logprobs is not None)
            if only_logprobs and entry.logprobs is not None:
                start = min(start, shared - 1)  # position shared - 1 predicts a token the entry does not share
                active.prompt_logprobs[active.logprobs_from : start] = entry.logprobs[active.logprobs_from : start]
            else:
                start = active.logits_from
        if start < prefix_cache.MIN_SHARED_TOKENS:
            return
        keys, values = active.keys, active.values
        assert keys is not None and values is not None  # _plan_prefill made them before calling this
        keys[:, :, :start] = entry.keys[:, :, :start]
        values[:, :, :start] = entry.values[:, :, :start]
        active.prefilled = active.cached = start
        self.prefixes.hits += 1
        self.prefixes.reused_tokens += start

    def _prefill(self, segments: list[tuple[_Active, int, int]], finished: list[SampleRequest]) -> None:
        """The prompt chunks, one forward pass per set of weights (segments come sorted by _adapter_key)."""
        for group in _by_weights(segments, lambda segment: segment[0]):
            self._prefill_packed(group, finished)

    def _prefill_packed(self, segments: list[tuple[_Active, int, int]], finished: list[SampleRequest]) -> None:
        """One forward pass over the prompt chunks, packed; requests whose prompt is complete start their rows."""
        start_time = time.perf_counter()
        device = self.model.device
        ids = [t for a, s, e in segments for t in a.request.prompt[s:e]]
        positions = [p for _, s, e in segments for p in range(s, e)]
        adapters = [a.request.adapter for a, s, e in segments for _ in range(s, e)]
        bounds, offset = [], 0  # where each chunk sits in the packed batch
        for _, s, e in segments:
            bounds.append((offset, offset + e - s))
            offset += e - s
        prompts_kv = []  # each chunk's prompt keys and values (made by _plan_prefill when its prefill began)
        for active, _, _ in segments:
            assert active.keys is not None and active.values is not None
            prompts_kv.append((active.keys, active.values))

        def attend(layer: int, q, k, v):
            out = torch.empty_like(q)
            q = q.to(self.cache_dtype)  # attention in the cache's dtype; `out` keeps the activations'
            for (_, s, e), (keys, values), (lo, hi) in zip(segments, prompts_kv, bounds):
                keys[layer, :, s:e] = k[lo:hi].transpose(0, 1)
                values[layer, :, s:e] = v[lo:hi].transpose(0, 1)
                # Causal within the prompt: position s + i sees positions 0 .. s + i (the last `window` of them
                # in a sliding-window layer). A whole prompt the window does not bind takes the plain causal path.
                window = self.windows[layer]
                plain = s == 0 and (window is None or window >= e)
                mask = None if plain else families.window_mask(torch.arange(s, e, device=device),
                                                               torch.arange(e, device=device), window)
                out[lo:hi] = families.attention(
                    q[lo:hi].transpose(0, 1)[None], keys[None, layer, :, :e], values[None, layer, :, :e],
                    mask=mask, causal=plain, scale=self.scaling, softcap=self.softcap,
                )[0].transpose(0, 1)
            return out

        with lora.route(self.model, adapters):
            hidden = flat_forward(self.model, torch.tensor(ids, device=device), torch.tensor(positions, device=device), attend)
        # lm_head only where logits are needed: from each request's logits_from (what it asks about
        # its prompt) to the end of its chunk; a prompt's last position always (it samples from it).
        wanted: list[int] = []
        firsts: list[int] = []
        for (active, s, e), (lo, hi) in zip(segments, bounds):
            firsts.append(len(wanted))
            wanted.extend(range(lo + max(0, active.logits_from - s), hi))
        logits = self._logits(hidden[wanted], [adapters[i] for i in wanted]) if wanted else None
        elapsed = time.perf_counter() - start_time
        for (active, s, e), first, (keys, values) in zip(segments, firsts, prompts_kv):
            active.request.compute_s += elapsed * (e - s) / len(ids)
            active.prefilled = e
            start = max(s, active.logits_from)
            if start < e:
                assert logits is not None  # positions start..e - 1 are in `wanted`
                active.score_prompt(logits[first : first + e - start], start)
            if e == len(active.request.prompt):
                assert logits is not None  # a prompt's last position is always in `wanted` (logits_from <= it)
                self.waiting.remove(active)
                known = [logprob for logprob in active.prompt_logprobs if logprob is not None]
                computed = known if len(known) == len(active.prompt_logprobs) else None  # None: some not computed
                self.prefixes.store(active.request.adapter, active.weights_version, active.request.prompt,
                                    keys, values, computed)
                self._start_rows(active, logits[first + e - start - 1], finished)

    def _start_rows(self, active: _Active, last_logits: torch.Tensor, finished: list[SampleRequest]) -> None:
        """The prompt is in: every row's first token from its last logits; rows that go on join the batch."""
        n = active.request.num_samples
        try:
            tokens, logprobs, tops = _choose_for([active] * n, list(range(n)), last_logits.float().expand(n, -1))
            going = [i for i in range(n) if active.take(i, tokens[i], logprobs[i], tops[i])]
        except Exception as e:  # on_token or stop-string decoding failed: this request alone
            active.request.error = e
            finished.append(active.request)
            return
        if going:
            keys, values = active.keys, active.values
            assert keys is not None and values is not None  # the prompt's, from its prefill (_prefill_packed)
            length = len(active.request.prompt)
            first = len(self.rows)
            self.cache.ensure(first + len(going), length + 1, self._reserved([*self._actives(), active])[1])
            rows = slice(first, first + len(going))
            self.cache.keys[:, rows, :, :length] = keys[:, None]
            self.cache.values[:, rows, :, :length] = values[:, None]
            self.rows += [_Row(active, i, length, tokens[i]) for i in going]
            self.peak_rows = max(self.peak_rows, len(self.rows))
        active.keys = active.values = None  # the rows have their own copies
        if active.rows_left == 0:
            active.finish()
            finished.append(active.request)

    def _actives(self) -> list[_Active]:
        return list({id(r.active): r.active for r in self.rows}.values())

    # ---- decode ---------------------------------------------------------------------------

    def _decode(self, finished: list[SampleRequest]) -> None:
        """One token for every live row: one forward pass (one per set of weights, when full runs are sampled)."""
        start_time = time.perf_counter()
        rows, device = self.rows, self.model.device
        n = len(rows)
        # The forward pass sees the rows grouped by adapter (each adapter's LoRA then works on one
        # contiguous run of rows); the cache keeps its own order, so attention puts its small
        # per-token inputs into cache order and its output back.
        order = sorted(range(n), key=lambda i: _adapter_key(rows[i].active))
        lengths = torch.tensor([r.length for r in rows], device=device)  # in cache order
        longest = int(lengths.max()) + 1
        self.cache.ensure(n, longest, self._reserved(self._actives())[1])
        slots = torch.arange(longest, device=device)
        # Each row's query sits at its length: what it sees of the cache, (rows, length), per distinct window.
        visible = {window: families.window_mask(lengths, slots, window) for window in set(self.windows)}
        chosen_tokens: list[int] = []  # in forward order
        chosen_logprobs: list[float] = []
        chosen_tops: list[list[tuple[int, float]] | None] = []
        for members in _by_weights(order, lambda i: rows[i].active):  # cache rows, in forward order
            group_rows = [rows[i] for i in members]
            adapters = [r.active.request.adapter for r in group_rows]
            attend = self._decode_attention(members, lengths, longest, visible)
            ids = torch.tensor([r.next_token for r in group_rows], device=device)
            with lora.route(self.model, adapters):
                hidden = flat_forward(self.model, ids, lengths[members], attend)
            logits = self._logits(hidden, adapters)
            group_tokens, group_logprobs, group_tops = _choose_for([r.active for r in group_rows],
                                                                   [r.index for r in group_rows], logits)
            chosen_tokens.extend(group_tokens)
            chosen_logprobs.extend(group_logprobs)
            chosen_tops.extend(group_tops)
        # Back to cache order (`order` is a permutation of the rows: every placeholder is replaced).
        tokens, logprobs = [0] * n, [0.0] * n
        tops: list[list[tuple[int, float]] | None] = [None] * n
        for j, i in enumerate(order):
            tokens[i], logprobs[i], tops[i] = chosen_tokens[j], chosen_logprobs[j], chosen_tops[j]
        elapsed = time.perf_counter() - start_time

        leaving, failed = set(), set()  # row indices; ids of failed requests' _Active
        for i, row in enumerate(rows):
            active = row.active
            active.request.compute_s += elapsed / n
            if id(active) in failed:
                continue
            try:
                going = active.take(row.index, tokens[i], logprobs[i], tops[i])
            except Exception as e:  # on_token or stop-string decoding failed: this request alone
                failed.add(id(active))
                active.request.error = e
                finished.append(active.request)
                continue
            row.length += 1
            row.next_token = tokens[i]
            if not going:
                leaving.add(i)
                if active.rows_left == 0:
                    active.finish()
                    finished.append(active.request)
        self._remove([i for i, r in enumerate(rows) if i in leaving or id(r.active) in failed])

    def _decode_attention(self, members: list[int], lengths: torch.Tensor, longest: int, visible: dict):
        """The `attend` of a decode step's forward pass over the cache rows `members`, in forward order: all of
        them (a permutation of 0..n-1: the cache is read as views, the small per-token inputs put into cache
        order and the output back), or some (a full run's rows: its keys and values gathered)."""
        device, n = self.model.device, len(self.rows)
        attention_work = 2 * len(members) * self.heads * self.head_dim * longest  # multiply-adds of a layer's attention
        if len(members) == n:
            permuted = members != list(range(n))
            forward_order = torch.tensor(members, device=device)
            cache_order = torch.argsort(forward_order)
            index = torch.arange(n, device=device)

            def attend(layer: int, q, k, v):
                with small_products.small(attention_work):  # a few rows' attention: tiny ops (engine/small_products.py)
                    if permuted:
                        q, k, v = q[cache_order], k[cache_order], v[cache_order]
                    keys, values = self.cache.keys[layer], self.cache.values[layer]
                    keys[index, :, lengths] = k.to(keys.dtype)
                    values[index, :, lengths] = v.to(values.dtype)
                    out = families.attention(
                        q[:, :, None].to(keys.dtype), keys[:n, :, :longest], values[:n, :, :longest],
                        mask=visible[self.windows[layer]][:, None, None, :], scale=self.scaling, softcap=self.softcap,
                    )[:, :, 0].to(q.dtype)
                    return out[forward_order] if permuted else out
            return attend
        index = torch.tensor(members, device=device)
        at = lengths[index]

        def attend_some(layer: int, q, k, v):
            with small_products.small(attention_work):
                keys, values = self.cache.keys[layer], self.cache.values[layer]
                keys[index, :, at] = k.to(keys.dtype)
                values[index, :, at] = v.to(values.dtype)
                return families.attention(
                    q[:, :, None].to(keys.dtype), keys[index, :, :longest], values[index, :, :longest],
                    mask=visible[self.windows[layer]][index][:, None, None, :], scale=self.scaling, softcap=self.softcap,
                )[:, :, 0].to(q.dtype)
        return attend_some

    def _remove(self, indices: list[int]) -> None:
        """Take rows out of the batch: the last live row moves into each hole."""
        for i in sorted(indices, reverse=True):
            last = len(self.rows) - 1
            if i != last:
                self.cache.move(last, i)
                self.rows[i] = self.rows[last]
            self.rows.pop()

    def _drop(self, condition, error: Exception, finished: list[SampleRequest]) -> None:
        """Remove every request for which condition(active) holds, failing it with `error`."""
        gone = [a for a in [*self.waiting, *self._actives()] if condition(a)]
        for active in gone:
            active.request.error = error
            finished.append(active.request)
        self.waiting = [a for a in self.waiting if not condition(a)]
        self._remove([i for i, r in enumerate(self.rows) if condition(r.active)])

    # ---- the model ------------------------------------------------------------------------

    @property
    def scaling(self) -> float:
        return self.model.model.layers[0].self_attn.scaling

    def _logits(self, hidden: torch.Tensor, adapters: list) -> torch.Tensor:
        with lora.route(self.model, adapters):
            return families.final_logits(self.model.config, self.model.lm_head(hidden).float())


def _by_weights(items: list, active_of) -> list[list]:
    """`items` (sorted by _adapter_key of their `active_of(item)`) split into runs on one set of weights each
    (lora.weights_key): one forward pass each."""
    groups: dict[int, list] = {}
    for item in items:
        groups.setdefault(lora.weights_key(active_of(item).request.adapter), []).append(item)
    return list(groups.values())


def _adapter_key(active: _Active) -> tuple[bool, int, int]:
    """The order rows and prompt chunks go through a step in: the base model's weights first, then each full run's
    (lora.weights_key), and by adapter within them."""
    adapter = active.request.adapter
    weights = lora.weights_key(adapter)
    return weights != 0, weights, id(adapter) if adapter is not None else 0


# ---- one request at a time (other architectures; the benchmarks' baseline) ---------------------


class SerialDecoder:
    """Each request alone, start to end, through transformers' own forward and KV cache.

    The loop all sampling used before the batched decoder, kept for architectures `Decoder` does
    not support and as the baseline of bench/sample.py (STEPWISE_SAMPLER=serial).
    """

    def __init__(self, model: torch.nn.Module, decode_text: Callable[[list[int]], str], budget_tokens: int) -> None:
        self.model: Any = model  # a transformers causal LM: torch types its attributes (device) loosely
        self.decode_text, self.budget_tokens = decode_text, budget_tokens
        self.waiting: list[SampleRequest] = []

    def admit(self, request: SampleRequest) -> None:
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def stats(self) -> dict:
        return {"decoder": "serial", "rows": 0, "waiting": len(self.waiting), "prefix_cache": None}

    def adapters(self) -> list:
        return [request.adapter for request in self.waiting]

    def prefill_room(self) -> int:
        return 0 if self.waiting else 1  # one request at a time

    def step(self) -> list[SampleRequest]:
        request = self.waiting.pop(0)
        start = time.perf_counter()
        if request.cancel.is_set():
            request.error = Cancelled("the request was cancelled")
        else:
            try:
                self._generate(_Active(request, self.decode_text))
            except Exception as e:
                request.error = e
        request.compute_s = time.perf_counter() - start
        return [request]

    @torch.inference_mode()
    def _generate(self, active: _Active) -> None:
        request, model = active.request, self.model
        n = request.num_samples
        with lora.route(model, [request.adapter] * n), lora.sampling(model):
            # Logits of the last positions only, from the first the request's prompt options need.
            out = model(torch.tensor([request.prompt], device=model.device), use_cache=True,
                        logits_to_keep=len(request.prompt) - active.logits_from)
            active.score_prompt(out.logits[0], active.logits_from)
            cache = out.cache
            cache.batch_repeat_interleave(n)
            logits = out.logits[:, -1, :].float().expand(n, -1)
            going = list(range(n))
            while True:
                tokens, logprobs, tops = _choose_for([active] * len(going), going, logits)
                going_on = [row for i, row in enumerate(going) if active.take(row, tokens[i], logprobs[i], tops[i])]
                if not going_on:
                    break
                # Rows keep their place in the cache after they stop (the cache cannot drop rows);
                # only the still-going rows' tokens matter, the others feed a placeholder.
                feed = {row: tokens[i] for i, row in enumerate(going) if row in going_on}
                step_ids = torch.tensor([[feed.get(row, 0)] for row in range(n)], device=model.device)
                out = model(step_ids, cache=cache, use_cache=True)
                cache = out.cache
                logits = out.logits[going_on, -1, :].float()
                going = going_on
        active.finish()
