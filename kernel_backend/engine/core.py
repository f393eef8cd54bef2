"""The compute owner: one frozen base model on one device, many LoRA adapters over it (and full fine-tuning
runs, each with its own copy of the weights: engine/full_weights.py).

Every training and sampling primitive is a method here: forward, forward_backward (gradients
accumulate until optim_step), optim_step (AdamW or Dimuon per adapter, engine/optimizers.py), sample, compute_logprobs,
save/load of state (weights + optimizer) and of sampler weights.

The engine is not thread-safe: one thread owns it (the scheduler, or a test). Every method
validates its input completely before it touches any state, so bad input raises UserError and
leaves weights, gradients and optimizer state as they were.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from kernel_backend.engine import (adapter_cache, base_models, constraints, families, full_weights, lora, losses, matmul,
                                   optimizers, packed_forward, prefix_tree, sampler, sharding)
from kernel_backend.engine.step_history import StepHistory, write_state, write_weights
from kernel_backend.config import Settings
from kernel_backend.types import (
    AdamParams,
    Datum,
    DimuonParams,
    ForwardResult,
    LoraConfig,
    SampleOptions,
    SampleResult,
    SamplingParams,
    check_logit_adjustments,
    check_sample_size,
)
from kernel_backend.errors import UserError

Weights = lora.Adapter | full_weights.FullWeights  # a run's weights: a LoRA adapter, or a full run's (rank 0)


@dataclass
class Pass:
    """One forward or forward_backward request on one adapter."""

    adapter_id: str
    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    forward_only: bool = False


@dataclass
class _Slot:
    """An adapter and, when it trains, its optimizer (AdamW or Dimuon: engine/optimizers.py)."""

    adapter: Weights
    optimizer: torch.optim.Optimizer | None = None
    steps: int = 0  # optim_steps applied


@dataclass
class _Row:
    """One datum of one pass, validated and turned into tensors."""

    pass_index: int
    tokens: list[int]
    targets: torch.Tensor  # (N,) or (N, K) int64
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


class Engine:
    def __init__(self, base_model: str = base_models.DEFAULT_MODEL, settings: Settings | None = None,
                 group=None) -> None:
        """`group`: a torch.distributed process group to shard the base model over (engine/sharding.py): this
        process loads its rows of the weights alone, and every process of the group must make this Engine and then
        make the same calls on it, in the same order (each product gathers its weight, a collective). Rank 0 of the
        group writes the checkpoints."""
        self.settings = settings or Settings()
        self.group = group
        dtype = getattr(torch, self.settings.dtype)
        product = matmul.choose(self.settings.matmul, self.settings.device, dtype)
        if group is None:
            self.base = base_models.load(base_model, self.settings.models_dir, self.settings.device, dtype,
                                         self.settings.base_models)
            lora.attach(self.base.model, product)
        else:
            self.base = _load_sharded(base_model, self.settings, dtype, product, group)
        self.model: Any = self.base.model  # a transformers model (torch types a module's attributes loosely)
        self.tokenizer: Any = self.base.tokenizer  # a transformers tokenizer
        self.vocab_size = self.base.vocab_size
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        # The sampler's bf16 copy of the base weights, if asked (STEPWISE_SAMPLE_DTYPE; ~270 MB on the default model).
        lora.sample_weights(self.model, self.settings.sample_dtype)
        self.decoder = self._make_decoder()
        self._grammars: constraints.Compiler | None = None  # made on the first constrained request (~0.3 s)
        # Every adapter this engine serves; what stays on the device is bounded in bytes (engine/adapter_cache.py).
        self.adapters = adapter_cache.AdapterCache(
            adapter_cache.budget_bytes(self.settings.adapter_cache_mb, self.settings.device),
            self.settings.max_adapter_mb_per_tenant << 20, self.settings.home / "spill", self.settings.device,
            in_use=lambda: {id(a) for a in self.decoder.adapters()})
        # Each run's state after its recent steps, to fork from or sample at (engine/step_history.py).
        self.history = StepHistory(self.settings.step_history, self.settings.step_history_mb << 20)

    @property
    def slots(self) -> dict[str, _Slot]:
        """The adapters resident on the device now, by id (what memory reports count)."""
        return self.adapters.resident()

    def memory(self) -> dict[str, int]:
        """The bytes this engine holds, by what holds them (GET /api/v1/cluster, bench/memory.py): the base
        model; resident adapters as the adapter cache counts them (a run's weights, gradients and optimizer
        state); the copies of recent steps (engine/step_history.py); the decoding rows' KV cache and the prefix
        cache of finished prompts (engine/sampler.py, engine/prefix_cache.py); the sampler's copy of the base weights
        in another dtype (STEPWISE_SAMPLE_DTYPE=bfloat16, engine/lora.py; none in float32)."""
        kv = getattr(self.decoder, "cache", None)
        prefixes = getattr(self.decoder, "prefixes", None)
        return {
            "base_model_bytes": sum(t.nbytes for t in [*self.model.parameters(), *self.model.buffers()]),
            "sampler_weights_bytes": lora.sample_weights_bytes(self.model),
            "adapter_bytes": self.adapters.stats()["resident_bytes"],
            "step_history_bytes": self.history.nbytes(),
            "sampler_kv_bytes": kv.keys.nbytes + kv.values.nbytes if kv is not None else 0,
            "prefix_cache_bytes": prefixes.nbytes() if prefixes is not None else 0,
        }

    def reset_decoder(self) -> None:
        """Forget every request in the decoder (after a failed step; the scheduler fails them)."""
        self.decoder = self._make_decoder()

    def _make_decoder(self) -> sampler.Decoder | sampler.SerialDecoder:
        """Every sample request on this model goes through this decoder (see engine/sampler.py)."""
        settings = self.settings
        if settings.sampler not in ("batched", "serial", "vllm"):  # with vllm, the engine decodes only its own checks
            raise ValueError(f"STEPWISE_SAMPLER must be 'batched', 'serial' or 'vllm', not {settings.sampler!r}")
        budget = sampler.cache_tokens(self.model, settings.sample_cache_mb)
        decode_text = self.tokenizer.decode
        if settings.sampler == "batched" and sampler.Decoder.supports(self.model):
            return sampler.Decoder(self.model, decode_text, budget, settings.prefill_chunk_tokens)
        return sampler.SerialDecoder(self.model, decode_text, budget)

    # ---- adapters ---------------------------------------------------------------------------

    def create_adapter(self, adapter_id: str, config: LoraConfig | None = None, optimizer: str = "adamw",
                       owner: str = "") -> None:
        """A new training run's adapter and optimizer; `owner` (a tenant) is whose share of the cache it uses.
        Rank 0 is full fine-tuning: the run trains its own copy of every weight (engine/full_weights.py)."""
        if adapter_id in self.adapters:
            raise UserError(f"adapter {adapter_id!r} already exists")
        config = config or LoraConfig()
        if self.group is not None and config.rank > 0 and config.seed is None:
            raise UserError("on a sharded model every process of the group makes the adapter: give it a seed "
                            "(LoraConfig.seed), or each process draws its own and they part ways")
        optimizers.check_kind(optimizer, full=config.rank == 0)
        adapter = full_weights.new(self.model, config) if config.rank == 0 else lora.new_adapter(self.model, config)
        slot = _Slot(adapter, optimizers.create(optimizer, adapter.parameters(), adapter.config.rank))
        self.adapters.add(adapter_id, slot, owner)
        # (a full run's weights too: StepHistory.record's annotation names lora.Adapter only)
        self.history.record(adapter_id, slot.adapter, slot.optimizer, 0)

    def delete_adapter(self, adapter_id: str) -> None:
        self.adapters.drop(adapter_id)
        self.history.forget(adapter_id)

    def has_adapter(self, adapter_id: str) -> bool:
        """Held, on the device or spilled (a checkpoint's sampler that was dropped is not: it loads again)."""
        return adapter_id in self.adapters

    def adapter_config(self, adapter_id: str) -> LoraConfig:
        return self._slot(adapter_id).adapter.config

    def steps(self, adapter_id: str) -> int | None:
        """Optim steps the adapter has taken (None if this engine does not hold it), without loading it."""
        return self.adapters.entry(adapter_id).slot.steps if adapter_id in self.adapters else None

    def _slot(self, adapter_id: str, keep=()) -> _Slot:
        """The adapter on the device (brought back first if it was spilled); `keep`: others this call needs."""
        try:
            return self.adapters.get(adapter_id, keep)
        except KeyError:
            raise UserError(
                f"unknown adapter {adapter_id!r}: it is not loaded (the server may have restarted); resume from a "
                "checkpoint with create_training_client_from_state_with_optimizer(path)"
            ) from None

    # ---- forward / backward -----------------------------------------------------------------

    def forward(self, adapter_id: str, data: list[Datum], loss_fn: str = "cross_entropy", loss_fn_config=None) -> ForwardResult:
        return self._one(Pass(adapter_id, data, loss_fn, loss_fn_config, forward_only=True))

    def forward_backward(self, adapter_id: str, data: list[Datum], loss_fn: str = "cross_entropy", loss_fn_config=None) -> ForwardResult:
        return self._one(Pass(adapter_id, data, loss_fn, loss_fn_config))

    def _one(self, p: Pass) -> ForwardResult:
        result = self.run_passes([p])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def run_passes(self, passes: list[Pass]) -> list[ForwardResult | Exception]:
        """Run several adapters' forward(_backward) requests as one batch.

        Rows of different adapters share each micro-batch (per-row LoRA routing). Each pass gets
        its own result or its own error: one bad request does not fail the others. At most one
        backward pass per adapter per call, so a failure can restore that adapter's gradients.
        """
        results: list[ForwardResult | Exception | None] = [None] * len(passes)
        rows: list[_Row] = []
        configs: list[dict[str, float]] = []
        trained = [p.adapter_id for p in passes if not p.forward_only]
        if len(set(trained)) != len(trained):
            raise ValueError("run_passes takes at most one backward pass per adapter")
        topk = [0] * len(passes)  # the top-k tokens per position each pass asks for (losses.TOPK_KEY)
        for i, p in enumerate(passes):
            # One entry per pass, whatever fails: configs[i] must stay pass i's config.
            try:
                config = losses.check_config(p.loss_fn, p.loss_fn_config)
                topk[i] = losses.topk_of(p.loss_fn_config)
                rows.extend(self._check_pass(i, p))
            except UserError as e:
                config = {}
                results[i] = e
            configs.append(config)
        live = [i for i, r in enumerate(results) if r is None]
        if not live:
            return _filled(results)

        needed = {passes[i].adapter_id for i in live}
        slots = {i: self._slot(passes[i].adapter_id, keep=needed) for i in live}
        # A forward-only pass runs on a detached view of its adapter: when it shares a micro-batch
        # with another adapter's backward pass, its parameters must not even receive zero gradients.
        routed = {i: slots[i].adapter if not passes[i].forward_only else slots[i].adapter.detached() for i in live}
        saved_grads = {i: _grads(slots[i].adapter) for i in live if not passes[i].forward_only}
        logprobs_of: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        tops_of: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in live}
        metrics_of: dict[int, list[tuple[dict[str, float], int]]] = {i: [] for i in live}
        computed_of = {i: 0 for i in live}  # tokens the model ran for the pass, each shared prefix once
        # Rows on the base model's weights first, then each full run's (a forward pass runs on one set of weights).
        pending = sorted((r for r in rows if results[r.pass_index] is None),
                         key=lambda r: lora.weights_key(routed[r.pass_index]) != 0)
        for batch in self._micro_batches(pending, [routed[r.pass_index] for r in pending]):
            active = [r for r in batch if results[r.pass_index] is None]
            if not active:
                continue
            any_backward = any(not passes[r.pass_index].forward_only for r in active)
            k = max(topk[r.pass_index] for r in active)
            with torch.set_grad_enabled(any_backward):
                row_logprobs, computed, row_tops = self._target_logprobs(active, [routed[r.pass_index] for r in active], k)
            total = None
            for i in dict.fromkeys(r.pass_index for r in active):
                computed_of[i] += computed[id(routed[i])]
                mine = [(r, lp) for r, lp in zip(active, row_logprobs) if r.pass_index == i]
                lp = torch.cat([x for _, x in mine])
                inputs = {k: torch.cat([r.inputs[k] for r, _ in mine]) for k in mine[0][0].inputs}
                try:
                    lengths = [len(r.tokens) for r, _ in mine]
                    loss, metrics = losses.compute_loss(passes[i].loss_fn, lp, inputs, configs[i], lengths)
                    if not math.isfinite(metrics["loss:sum"]):
                        raise UserError(
                            f"the {passes[i].loss_fn} loss is not finite ({metrics['loss:sum']}); check that "
                            "loss_fn_inputs 'logprobs' are the sampler's logprobs and advantages are moderate"
                        )
                except UserError as e:
                    results[i] = e
                    continue
                logprobs_of[i].extend(x.detach() for _, x in mine)
                if topk[i]:
                    tops_of[i].extend((ids[:, :topk[i]], lps[:, :topk[i]])
                                      for r, (ids, lps) in zip(active, row_tops) if r.pass_index == i)
                metrics_of[i].append((metrics, lp.numel()))
                if not passes[i].forward_only:
                    total = loss if total is None else total + loss
            if total is not None:
                total.backward()

        for i in saved_grads:  # a finite loss can still overflow in backward: never keep inf/NaN gradients
            # On a sharded model each process sees its shards' gradients: one's non-finite shard fails the pass on all.
            if results[i] is None and self._on_any_process(not _grads_finite(slots[i].adapter)):
                results[i] = UserError(
                    f"the {passes[i].loss_fn} loss gave non-finite gradients; check that loss_fn_inputs "
                    "'logprobs' are the sampler's logprobs and advantages are moderate"
                )
        for i in live:
            if isinstance(results[i], Exception):
                if i in saved_grads:
                    _restore_grads(slots[i].adapter, saved_grads[i])
                continue
            outputs = [{"logprobs": lp.float().cpu().numpy()} for lp in logprobs_of[i]]
            for out, (ids, lps) in zip(outputs, tops_of[i]):
                out.update(topk_token_ids=ids.cpu().numpy(), topk_logprobs=lps.float().cpu().numpy())
            results[i] = ForwardResult(
                loss_fn_outputs=outputs,
                metrics=losses.merge_metrics(metrics_of[i]),
                computed_tokens=computed_of[i],
            )
        return _filled(results)

    def _check_pass(self, index: int, p: Pass) -> list[_Row]:
        """Validate one request completely; return its rows as tensors. Raises UserError."""
        if p.adapter_id not in self.adapters:
            self._slot(p.adapter_id)  # raises the unknown adapter's error
        if not p.data:
            raise UserError("empty batch: forward_backward needs at least one Datum")
        if not p.forward_only and self.adapters.entry(p.adapter_id).slot.optimizer is None:
            raise UserError(f"{p.adapter_id!r} is a sampler snapshot and cannot be trained")
        needed = losses.required_inputs(p.loss_fn)
        optional = losses.optional_inputs(p.loss_fn)
        known = losses.known_inputs()  # the names some loss reads (losses.LOSSES); others are rejected by name
        total_tokens = sum(len(d.tokens) for d in p.data)
        if total_tokens > self.settings.max_batch_tokens:
            raise UserError(
                f"batch has {total_tokens} tokens, over the limit of {self.settings.max_batch_tokens}; "
                "split it into several forward_backward calls before optim_step"
            )
        rows = []
        for n, datum in enumerate(p.data):
            where = f"data[{n}]"
            tokens = _check_tokens(datum.tokens, self.vocab_size, f"{where}.model_input")
            if len(tokens) > self.max_context:
                raise UserError(f"{where} has {len(tokens)} tokens, over the model's context of {self.max_context}")
            unknown = set(datum.loss_fn_inputs) - set(known)
            if unknown:
                raise UserError(
                    f"{where}.loss_fn_inputs has unknown key(s) {sorted(unknown)}; known: {', '.join(known)}"
                )
            if "target_tokens" not in datum.loss_fn_inputs:
                raise UserError(f"{where}.loss_fn_inputs needs 'target_tokens' (the token each position predicts)")
            targets = np.asarray(datum.loss_fn_inputs["target_tokens"])
            if targets.ndim not in (1, 2) or targets.shape[0] != len(tokens):
                raise UserError(
                    f"{where}.loss_fn_inputs['target_tokens'] has shape {targets.shape} but model_input has "
                    f"{len(tokens)} tokens; give one target per input position: shape ({len(tokens)},) or ({len(tokens)}, K)"
                )
            if not np.issubdtype(targets.dtype, np.integer):
                if not np.all(np.isfinite(targets)) or not np.all(targets == np.round(targets)):
                    raise UserError(f"{where}.loss_fn_inputs['target_tokens'] must be integer token ids")
            targets = targets.astype(np.int64)
            _check_range(targets, self.vocab_size, f"{where}.loss_fn_inputs['target_tokens']")
            inputs = {}
            for name in needed:
                if name not in datum.loss_fn_inputs:
                    raise UserError(
                        f"{where}.loss_fn_inputs is missing {name!r}, which loss_fn {p.loss_fn!r} needs "
                        f"(it needs: target_tokens, {', '.join(needed)})"
                    )
            for name in (*needed, *optional):
                if name not in datum.loss_fn_inputs:
                    continue
                value = np.asarray(datum.loss_fn_inputs[name], dtype=np.float32)
                if value.shape != targets.shape:
                    raise UserError(
                        f"{where}.loss_fn_inputs[{name!r}] has shape {value.shape}, expected {targets.shape} "
                        "(the shape of target_tokens)"
                    )
                if not np.all(np.isfinite(value)):
                    raise UserError(f"{where}.loss_fn_inputs[{name!r}] contains NaN or inf; pass finite numbers")
                inputs[name] = torch.from_numpy(value)
            for name, fill in optional.items():  # keep the same keys on every row for concatenation
                inputs.setdefault(name, torch.full(targets.shape, fill, dtype=torch.float32))
            rows.append(_Row(index, tokens, torch.from_numpy(targets), inputs))
        return rows

    def _tree_key(self, adapter: Weights, n: int) -> tuple[int, int]:
        """Row n's key in a prefix_tree.Tree: rows of one adapter share their prefixes, unless sharing is off
        (settings.share_prefixes) or the model runs padded through transformers (not sampler.Decoder.supports)."""
        shared = self.settings.share_prefixes and sampler.Decoder.supports(self.model)
        return id(adapter), 0 if shared else n

    def _micro_batches(self, rows: list[_Row], adapters: list[Weights]) -> list[list[_Row]]:
        """Group rows so that each micro-batch stays within micro_batch_tokens: the tokens the model runs, where
        rows of one adapter that share a prefix share its tokens (engine/prefix_tree.py, _tree_key), or, padded through
        transformers (not sampler.Decoder.supports), its rows x their longest. A full run's rows are micro-batches of
        their own (lora.weights_key)."""
        packed = sampler.Decoder.supports(self.model)
        batches: list[list[_Row]] = []
        current: list[_Row] = []
        tree = prefix_tree.Tree()
        for n, (row, adapter) in enumerate(zip(rows, adapters)):
            key = self._tree_key(adapter, n)
            cost = (tree.cost_with(key, row.tokens) if packed
                    else (len(current) + 1) * max([len(row.tokens), *(len(r.tokens) for r in current)]))
            other_weights = current and lora.weights_key(adapter) != lora.weights_key(adapters[n - 1])
            if current and (cost > self.settings.micro_batch_tokens or other_weights):
                batches.append(current)
                current, tree = [], prefix_tree.Tree()
            current.append(row)
            tree.add(key, row.tokens)
        if current:
            batches.append(current)
        return batches

    def _target_logprobs(self, rows: list[_Row], adapters: list[Weights], topk: int = 0
                         ) -> tuple[list[torch.Tensor], Counter, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each row's logprobs of its target tokens, the tokens the model ran per adapter (by id), and with
        `topk` each row's k most likely tokens per position with their logprobs (losses.top_logprobs). The
        families of engine/families.py run the rows as one tree of tokens, no padding, every shared prefix once (the
        sampler's own forward pass, packed_forward.flat_forward); others right-padded through transformers' forward."""
        if sampler.Decoder.supports(self.model):
            return self._packed_target_logprobs(rows, adapters, topk)
        device = self.model.device
        length = max(len(r.tokens) for r in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.tokens)] = torch.tensor(r.tokens)
            mask[i, : len(r.tokens)] = 1
        padded = any(len(r.tokens) < length for r in rows)
        with lora.route(self.model, adapters):
            # Without padding no mask at all: the attention takes its plain causal path.
            logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device) if padded else None).logits
        logits = logits.float()  # a no-op in float32
        computed: Counter[int] = Counter()
        for r, adapter in zip(rows, adapters):
            computed[id(adapter)] += len(r.tokens)
        tops = [losses.top_logprobs(logits[i, : len(r.tokens)], topk) for i, r in enumerate(rows)] if topk else []
        ks = {1 if r.targets.dim() == 1 else r.targets.shape[1] for r in rows}
        if len(ks) == 1:  # the usual case: one fused op over the whole padded batch
            k = ks.pop()
            targets = torch.zeros(len(rows), length, k, dtype=torch.long)
            for i, r in enumerate(rows):
                targets[i, : len(r.tokens)] = r.targets.reshape(len(r.tokens), k)
            lp = losses.target_logprobs(logits, targets.to(device))
            return [lp[i, : len(r.tokens)].reshape(r.targets.shape) for i, r in enumerate(rows)], computed, tops
        out = []
        for i, r in enumerate(rows):
            targets = r.targets.to(device).reshape(len(r.tokens), -1)
            out.append(losses.target_logprobs(logits[i, : len(r.tokens)], targets).reshape(r.targets.shape))
        return out, computed, tops

    def _packed_target_logprobs(self, rows: list[_Row], adapters: list[Weights], topk: int = 0):
        """The rows as one flat batch of tokens, every prefix that rows of one adapter share computed once
        (engine/prefix_tree.py): no product sees a padding token or a token twice, attention stays within each row."""
        device = self.model.device
        tree = prefix_tree.Tree()
        for n, (row, adapter) in enumerate(zip(rows, adapters)):
            tree.add(self._tree_key(adapter, n), row.tokens)
        by_id = {id(a): a for a in adapters}
        ids = torch.tensor(tree.tokens, device=device)
        positions = torch.tensor(tree.positions, device=device)
        attend = packed_forward.causal_within_paths(self.model, tree.leaf_paths(), device)
        keys = cast(list[tuple[int, int]], tree.keys)  # the keys added above, _tree_key's (the Tree takes any)
        with lora.route(self.model, [by_id[adapter] for adapter, _ in keys]):
            hidden = packed_forward.flat_forward(self.model, ids, positions, attend)
            logits = families.final_logits(self.model.config, self.model.lm_head(hidden).float())  # .float(): a no-op in float32
        computed = Counter(adapter for adapter, _ in keys)
        lengths = [len(r.tokens) for r in rows]
        tops = []
        if topk:  # a node's top-k once, each row reading its path's nodes
            node_ids, node_lps = losses.top_logprobs(logits, topk)
            tops = [(node_ids[path], node_lps[path]) for path in map(torch.from_numpy, tree.paths)]
        if len({1 if r.targets.dim() == 1 else r.targets.shape[1] for r in rows}) == 1:  # the usual case: one op
            targets = torch.cat([r.targets.reshape(len(r.tokens), -1) for r in rows]).to(device)
            index = torch.from_numpy(np.concatenate(tree.paths)).to(device)
            # The logits are read no more (the top-k above were taken first): their log_softmax goes over them.
            logprobs = losses.target_logprobs(logits, targets, index, overwrite=True)
            return [lp.reshape(r.targets.shape) for lp, r in zip(logprobs.split(lengths), rows)], computed, tops
        return [losses.target_logprobs(logits, r.targets.to(device).reshape(len(r.tokens), -1),
                                torch.from_numpy(path).to(device)).reshape(r.targets.shape)
                for path, r in zip(tree.paths, rows)], computed, tops

    # ---- optimizer --------------------------------------------------------------------------

    def optim_step(self, adapter_id: str, params: AdamParams | DimuonParams | None = None) -> dict[str, float]:
        """One step of the adapter's optimizer on the gradients accumulated since the last step, then zero them.

        `params` must match the optimizer the adapter was created with (AdamParams for AdamW).
        A step that would leave the adapter unusable (non-finite weights or optimizer state, or
        non-finite outputs on a probe input, as an absurd learning rate does) is undone: UserError,
        and weights, gradients and optimizer state are exactly as they were before the call."""
        params = params or AdamParams()
        slot = self._slot(adapter_id)
        if slot.optimizer is None:
            raise UserError(f"{adapter_id!r} is a sampler snapshot and cannot be trained")
        before = _Snapshot(slot)
        try:
            metrics = self._step(slot, params)
            problem = self._unusable(slot)
        except BaseException:
            before.restore(slot)
            raise
        if problem:
            before.restore(slot)
            raise UserError(
                f"this optim_step would make the adapter {problem} (learning_rate {params.learning_rate:g}); it was "
                "not applied and the adapter is unchanged: lower the learning rate (or set grad_clip_norm)"
            )
        # (a full run's weights too: StepHistory.record's annotation names lora.Adapter only)
        self.history.record(adapter_id, slot.adapter, slot.optimizer, slot.steps)
        return metrics

    def _unusable(self, slot: _Slot) -> str | None:
        """Why an adapter can no longer be trained or sampled from, or None if it is fine."""
        # Each check agreed over a sharded model's group (a full run's shards differ by process): a step one process
        # finds unusable is undone on every one, or their weights part ways.
        tensors: list[torch.Tensor] = [*slot.adapter.parameters()]  # (the foreach ops take a list of Tensors)
        weights_finite = bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all())
        if self._on_any_process(not weights_finite):
            return "weights non-finite"
        optimizer = slot.optimizer
        assert optimizer is not None  # optim_step's: a run that trains (a sampler snapshot has no optimizer)
        moments = [v for state in optimizer.state.values() for k, v in state.items()
                   if k != "step" and torch.is_tensor(v)]
        moments_finite = not moments or bool(torch.isfinite(torch.stack(torch._foreach_norm(moments))).all())
        if self._on_any_process(not moments_finite):
            return "optimizer state non-finite"
        probe = torch.arange(1, min(9, self.vocab_size), device=self.model.device)[None]
        with torch.no_grad(), lora.route(self.model, [slot.adapter.detached()]):
            logits = self.model(input_ids=probe, logits_to_keep=1).logits
        return None if bool(torch.isfinite(logits).all()) else "output non-finite"

    def _on_any_process(self, flag: bool) -> bool:
        """`flag` on an unsharded model; on a sharded one, whether it holds on any process of the group."""
        return flag if self.group is None else sharding.on_any_process(flag, self.model)

    def _step(self, slot: _Slot, params: AdamParams | DimuonParams) -> dict[str, float]:
        optimizer = slot.optimizer
        assert optimizer is not None  # optim_step's: a run that trains (a sampler snapshot has no optimizer)
        optimizers.configure(optimizer, params)  # checks params first; raises before any change
        trainable = slot.adapter.parameters()
        grads = [p.grad for p in trainable if p.grad is not None]
        if self.group is None:
            grad_norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else 0.0
            if params.grad_clip_norm > 0 and grads:
                torch.nn.utils.clip_grad_norm_(trainable, params.grad_clip_norm, foreach=True)
        else:
            # A full run's shards hold a part of each gradient each: the norm is the group's (a collective, made on
            # every process even without gradients), and every process clips by that one norm, as unsharded.
            grad_norm = sharding.grad_norm(self.model, slot.adapter)
            if params.grad_clip_norm > 0 and grads:
                torch.nn.utils.clip_grads_with_norm_(trainable, params.grad_clip_norm, torch.tensor(grad_norm),
                                                     foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        slot.steps += 1
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": params.learning_rate}

    # ---- sampling ---------------------------------------------------------------------------

    def sample_request(
        self,
        adapter_id: str | None,
        prompt: list[int],
        num_samples: int = 1,
        params: SamplingParams | None = None,
        options: SampleOptions | None = None,
        on_token=None,
        cancel=None,
    ) -> sampler.SampleRequest:
        """A validated request for the decoder: continuations of `prompt` from the base model
        (adapter_id None) or an adapter, and what `options` asks besides. Raises UserError for bad input."""
        params = dataclasses.replace(params) if params is not None else SamplingParams()
        options = options or SampleOptions()
        adapter = self._slot(adapter_id).adapter if adapter_id is not None else None
        prompt = _check_tokens(prompt, self.vocab_size, "prompt")
        stop_ids, stop_strings = self._check_sampling(prompt, num_samples, params, options)
        request = sampler.SampleRequest(
            adapter,
            prompt, num_samples, params, stop_ids, stop_strings, options, on_token)
        if options.grammar is not None:
            request.constraint = self.grammars().compile(options.grammar)
        if cancel is not None:
            request.cancel = cancel
        if request.kv_tokens > self.decoder.budget_tokens:
            raise UserError(
                f"num_samples ({num_samples}) x (prompt {len(prompt)} + max_tokens {params.max_tokens}) = "
                f"{request.kv_tokens} tokens is more than the sampler's cache holds ({self.decoder.budget_tokens}); "
                "lower num_samples or max_tokens, or raise STEPWISE_SAMPLE_CACHE_MB"
            )
        return request

    def grammars(self) -> constraints.Compiler:
        """The compiled grammars of constrained sampling, for this engine's tokenizer (engine/constraints.py)."""
        if self._grammars is None:
            self._grammars = constraints.Compiler(self.tokenizer, self.vocab_size, self._eos_ids())
        return self._grammars

    def run_requests(self, requests: list[sampler.SampleRequest]) -> list[SampleResult | Exception]:
        """Decode requests together until every one is done (tests and benchmarks; the service's
        scheduler drives the decoder itself, step by step)."""
        for request in requests:
            self.decoder.admit(request)
        left = {id(r) for r in requests}
        while left:
            left -= {id(r) for r in self.decoder.step()}
        return [_outcome(r) for r in requests]

    def sample(self, adapter_id: str | None, prompt: list[int], num_samples: int = 1,
               params: SamplingParams | None = None, **options) -> SampleResult:
        """Sample continuations of `prompt` now (options: SampleOptions' fields, e.g. prompt_logprobs=True)."""
        request = self.sample_request(adapter_id, prompt, num_samples, params, SampleOptions(**options))
        result = self.run_requests([request])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def compute_logprobs(self, adapter_id: str | None, tokens: list[int]) -> list[float | None]:
        """Logprob of each token given the ones before it (None for the first)."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        logprobs = self.sample(adapter_id, tokens, 1, params, prompt_logprobs=True).prompt_logprobs
        assert logprobs is not None  # asked for (prompt_logprobs=True)
        return logprobs

    def _check_sampling(self, prompt, num_samples, params: SamplingParams, options: SampleOptions):
        if not prompt:
            raise UserError("prompt is empty: give at least one token")
        check_sample_size(len(prompt), num_samples, params, self.max_context, self.settings.max_sample_tokens, options)
        if not math.isfinite(params.temperature) or params.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {params.temperature}")
        if not (0 < params.top_p <= 1):
            raise UserError(f"top_p must be in (0, 1], got {params.top_p}")
        if params.top_k == 0 or params.top_k < -1:
            raise UserError(f"top_k must be -1 (off) or a positive integer, got {params.top_k}")
        check_logit_adjustments(params, self.vocab_size)
        if options.target_prompt_logprobs is not None:
            ids = options.target_prompt_logprobs.ids
            _check_range(ids[ids >= 0], self.vocab_size, "target_prompt_logprobs (token ids, or -1)")
        eos = self._eos_ids()
        stop = params.stop
        if stop is None:
            return eos, []
        if isinstance(stop, str):
            stop = [stop]
        if all(isinstance(s, str) for s in stop):
            if any(s == "" for s in stop):
                raise UserError("stop strings must not be empty")
            return (eos if stop else set()), list(stop)
        if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            _check_range(np.asarray(stop), self.vocab_size, "stop token ids")
            return eos | set(stop), []
        raise UserError("stop must be a list of strings or a list of token ids, not a mix")

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = self.model.generation_config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- checkpoints ------------------------------------------------------------------------

    def save_state(self, adapter_id: str, directory: Path) -> None:
        """Weights (PEFT format) plus optimizer state, written atomically into `directory`."""
        slot = self._slot(adapter_id)
        state, kind = {}, "adamw"
        if slot.optimizer is not None:
            state = optimizers.state_tensors(slot.optimizer, slot.adapter.named_parameters())
            kind = optimizers.kind_of(slot.optimizer)
        adapter, state = self._whole(slot.adapter, state)
        if self._writes():
            with _atomic_dir(directory) as tmp:
                write_state(tmp, adapter, state, kind, slot.steps, self.base)

    def kept_steps(self, adapter_id: str) -> list[int]:
        """The steps whose state this engine can still write (save_step): the kept ones and the current one."""
        current = self.steps(adapter_id)
        return sorted({*self.history.steps(adapter_id), *([current] if current is not None else [])})

    def save_step(self, adapter_id: str, step: int, directory: Path, with_optimizer: bool = True) -> None:
        """The run's state after `step` (save_state's folder; the adapter alone without the optimizer), from the
        step history or, for the step it is at, from the run itself."""
        if step == self.steps(adapter_id):
            return self.save_state(adapter_id, directory) if with_optimizer else self.save_weights_for_sampler(
                adapter_id, directory)
        state = self.history.get(adapter_id, step)
        if state is None:
            raise UserError(f"the state after step {step} of {adapter_id} is no longer kept in memory; kept steps: "
                            f"{self.kept_steps(adapter_id)} (older ones only where a snapshot was written)")
        adapter, optimizer_state = self._whole(state.adapter, state.optimizer_state if with_optimizer else {})
        if not self._writes():
            return
        with _atomic_dir(directory) as tmp:
            if with_optimizer:
                write_state(tmp, adapter, optimizer_state, state.optimizer_kind, step, self.base)
            else:
                write_weights(tmp, adapter, self.base)

    def load_state(self, adapter_id: str, directory: Path, with_optimizer: bool = True,
                   optimizer: str | None = None, owner: str = "") -> None:
        """Create (or replace) `adapter_id` from a save_state directory.

        With the optimizer state the run keeps the optimizer it was saved with (`optimizer`, if
        given, must name the same one); weights alone get a fresh `optimizer` (default AdamW).
        """
        directory = Path(directory)
        meta = _state_facts(directory)
        restore = with_optimizer and (directory / "optimizer.safetensors").exists()
        saved_kind = meta.get("optimizer", "adamw")  # checkpoints from before Dimuon hold AdamW state
        if restore and optimizer is not None and optimizer != saved_kind:
            raise UserError(
                f"this checkpoint holds {saved_kind} optimizer state, which cannot be restored into a {optimizer} "
                "optimizer; load the weights alone (create_training_client_from_state) to switch optimizers"
            )
        kind = saved_kind if restore else (optimizer or "adamw")
        adapter = self._load_weights(directory, meta, trainable=True)
        optimizers.check_kind(kind, full=adapter.full)
        opt = optimizers.create(kind, adapter.parameters(), adapter.config.rank)
        steps = 0
        if restore:
            saved = load_file(directory / "optimizer.safetensors")
            if self.group is not None:  # the saved state is whole (save_state's): this process's rows of it
                saved = sharding.shard_tensors(self.model, saved)
            optimizers.load_state_tensors(opt, adapter.named_parameters(), saved)
            steps = meta.get("steps", 0)
        self.adapters.add(adapter_id, _Slot(adapter, opt, steps), owner)
        # A load replaces the run's state (an undo, say): the kept steps from there on are no longer its past.
        self.history.drop_from(adapter_id, steps)
        self.history.record(adapter_id, adapter, opt, steps)

    def save_weights_for_sampler(self, adapter_id: str, directory: Path) -> None:
        """The adapter's weights alone, in PEFT format (what vLLM and peft load); a full run's as a model folder."""
        adapter, _ = self._whole(self._slot(adapter_id).adapter, {})
        if self._writes():
            with _atomic_dir(directory) as tmp:
                write_weights(tmp, adapter, self.base)

    def _whole(self, adapter: Weights, optimizer_state: dict[str, torch.Tensor]
               ) -> tuple[Weights, dict[str, torch.Tensor]]:
        """A run's weights and optimizer tensors as a checkpoint holds them: on a sharded model a full run's whole,
        under the unsharded model's names, so that the folder loads on any number of processes (a collective: every
        process gathers, _writes says which one writes). A LoRA adapter is whole already: the same on every process."""
        if self.group is None or not adapter.full:
            return adapter, optimizer_state
        assert isinstance(adapter, full_weights.FullWeights)  # (adapter.full)
        return sharding.whole_weights(self.model, adapter), sharding.whole_tensors(self.model, optimizer_state)

    def _writes(self) -> bool:
        """Whether this process writes the checkpoints: always unsharded; on a sharded model the group's rank 0 (the
        others return once they have gathered, before it is written)."""
        return self.group is None or dist.get_rank(self.group) == 0

    def load_sampler(self, sampler_id: str, directory: Path, owner: str = "") -> None:
        """A frozen adapter for sampling, from save_weights_for_sampler or save_state output. The cache may
        drop it when it needs room: the caller loads it again from the same files (ops.sample_request)."""
        adapter = self._load_weights(Path(directory), _state_facts(Path(directory)), trainable=False)
        self.adapters.add(sampler_id, _Slot(adapter), owner, reloadable=True)

    def _load_weights(self, directory: Path, meta: dict, trainable: bool):
        """A checkpoint's weights: a full run's (a model folder, engine/full_weights.py) or a LoRA adapter (PEFT)."""
        if full_weights.is_checkpoint(directory):
            config = LoraConfig(**meta["lora"]) if "lora" in meta else LoraConfig(rank=0)
            if self.group is not None:  # a whole model folder, cut into this process's rows
                return sharding.load_full(self.model, directory, config, trainable)
            return full_weights.load(self.model, directory, config, trainable)
        if not (directory / "adapter_model.safetensors").exists():
            raise UserError(f"no saved weights at {directory}")
        return lora.load_peft(self.model, directory, trainable)

    def snapshot_sampler(self, adapter_id: str, sampler_id: str, owner: str = "") -> None:
        """A frozen in-memory copy of an adapter's current weights, for sampling while it trains."""
        copy = self._slot(adapter_id).adapter.copy()
        self.adapters.add(sampler_id, _Slot(copy), owner, keep=(adapter_id,))

    def weights_digest(self, adapter_id: str) -> str:
        """A hash of the adapter's weights and optimizer state (tests use it to prove nothing changed)."""
        import hashlib

        slot = self._slot(adapter_id)
        h = hashlib.sha256()
        for name, p in slot.adapter.named_parameters():
            h.update(name.encode())
            h.update(p.detach().cpu().numpy().tobytes())
            if p.grad is not None:
                h.update(p.grad.cpu().numpy().tobytes())
            if slot.optimizer is not None:
                for key, value in sorted(slot.optimizer.state.get(p, {}).items()):
                    h.update(key.encode())
                    h.update(torch.as_tensor(value).cpu().numpy().tobytes())
        return h.hexdigest()


# ---- helpers ---------------------------------------------------------------------------------


def _load_sharded(name: str, settings: Settings, dtype: torch.dtype, product, group) -> base_models.BaseModel:
    """base_models.load and lora.attach together, the model sharded over `group` (sharding.load_sharded): this
    process reads its rows of the weights from the files, and never holds the whole model."""
    from transformers import AutoTokenizer

    if settings.sample_dtype == "bfloat16" and dtype != torch.bfloat16:  # (a bfloat16 base needs no copy)
        raise UserError(f"STEPWISE_SAMPLE_DTYPE={settings.sample_dtype} makes the sampler a copy of every base weight, "
                        "whole: a sharded model samples on its shards; set STEPWISE_SAMPLE_DTYPE=float32")
    canonical, path = base_models.resolve(name, settings.models_dir, settings.base_models)
    model = sharding.load_sharded(path, group, dtype, settings.device, product)
    return base_models.BaseModel(canonical, path, model, AutoTokenizer.from_pretrained(path))


def _state_facts(directory: Path) -> dict:
    """save_state's stepwise_state.json (steps, the LoRA config, the optimizer), {} for weights alone."""
    meta_file = directory / "stepwise_state.json"
    return json.loads(meta_file.read_text()) if meta_file.exists() else {}


class _Snapshot:
    """A copy of an adapter's weights, gradients and AdamW state, to undo an optim_step exactly."""

    def __init__(self, slot: _Slot) -> None:
        params = slot.adapter.parameters()
        optimizer = slot.optimizer
        assert optimizer is not None  # optim_step's: a run that trains (a sampler snapshot has no optimizer)
        self.weights = [p.detach().clone() for p in params]
        self.grads = [None if p.grad is None else p.grad.clone() for p in params]
        self.state: dict[torch.Tensor, dict[str, Any]] = {
            p: {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
            for p in params if p in optimizer.state}
        self.groups = [dict(g, params=None) for g in optimizer.param_groups]
        self.steps = slot.steps

    def restore(self, slot: _Slot) -> None:
        params = slot.adapter.parameters()
        with torch.no_grad():
            for p, w, g in zip(params, self.weights, self.grads):
                p.copy_(w)
                p.grad = g
        optimizer = slot.optimizer
        assert optimizer is not None  # the snapshot's run (its optimizer stays)
        optimizer.state.clear()
        optimizer.state.update(self.state)
        for group, saved in zip(optimizer.param_groups, self.groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        slot.steps = self.steps


def _check_tokens(tokens, vocab_size: int, where: str) -> list[int]:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0:
        raise UserError(f"{where} must be a non-empty list of token ids, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"{where} must hold integer token ids, got {arr.dtype}")
    _check_range(arr, vocab_size, where)
    return arr.astype(np.int64).tolist()


def _check_range(arr: np.ndarray, vocab_size: int, where: str) -> None:
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
        raise UserError(f"{where} has token id {bad}, outside the vocabulary [0, {vocab_size}); use this model's tokenizer")


def _filled(results: list[ForwardResult | Exception | None]) -> list[ForwardResult | Exception]:
    """run_passes' results, once every pass has its result or its error."""
    filled = [r for r in results if r is not None]
    assert len(filled) == len(results)
    return filled


def _outcome(request: sampler.SampleRequest) -> SampleResult | Exception:
    """A decoded request's result or error (the decoder sets one of them when the request leaves it)."""
    outcome = request.error if request.error is not None else request.result
    assert outcome is not None
    return outcome


def _grads_finite(adapter: Weights) -> bool:
    grads = [p.grad for p in adapter.parameters() if p.grad is not None]
    if not grads:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())


def _grads(adapter: Weights) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in adapter.parameters()]


def _restore_grads(adapter: Weights, grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(adapter.parameters(), grads):
        p.grad = g


class _atomic_dir:
    """Write a directory under a temporary name, then rename it into place."""

    def __init__(self, target: Path) -> None:
        self.target = Path(target)

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.target.exists():
            shutil.rmtree(self.target)
        self.tmp.rename(self.target)
