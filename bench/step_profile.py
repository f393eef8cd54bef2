"""Where a prefill's and a training step's time go, and how far each is from the machine's product rate (issue 54:
"the same profile for prefill (long multi-turn prompts) and for the training step"). The decode step's profile is
bench/decode_profile.py; this script reuses its timers and wrappers (`Timers`, `instrument`, `best_of`), so that a part
means here what it means there.

Two phases, in one run, on the real default model (SmolLM2-135M-Instruct, float32):

- prefill: `--prompts` long multi-turn chat prompts of at least `--prompt-tokens` tokens each (each its own system
           message, so that they share no prefix; the decoder reset before each run, so that nothing is cached),
           sampled with max_tokens 1 through the sampler's own path (engine.run_requests -> Decoder._prefill, in
           chunks of the engine's prefill_chunk_tokens, 512), with a rank-`--prefill-rank` LoRA adapter on every
           target and on the base model alone. Each prefill step is timed whole ("plain" runs) and, in other runs
           of the same prompts, by parts ("timed" runs): the decode profile's wrappers (base products by kind, LoRA
           products, norms, rotary, elementwise, embedding, the linear layers' own Python) and the step's attention
           (every `attend` that flat_forward calls: cache writes, masks, SDPA). Plain and timed runs alternate.
- train:   forward_backward(cross_entropy) + optim_step (AdamW) of a rank-`--rank` LoRA run on `--batch` x `--seq`
           tokens (issue 54: 8 x 128), as bench/train_step.py runs it (its `Ours`, `make_batch`). Every step is split
           by phase (a few wrappers, on every step): forward (Engine._target_logprobs: the packed forward, lm_head,
           the target logprobs), the loss, backward (Tensor.backward), forward_backward's own Python (checks,
           packing, results), and optim_step's parts: its undo copy (core._Snapshot), the AdamW step (Engine._step),
           the usability probe (Engine._unusable: an 8-token forward pass), the step history's copy. Every other
           step ("timed") also breaks the forward down by part (the decode profile's wrappers, and the target
           logprobs' log_softmax) and the backward by autograd node (torch.profiler: each node's time; products split
           by the weight they multiply: LoRA's in lora._AddDeltas, lm_head's and the layers' base products).
- floor:   in the same run, after each phase: the product rate (GFLOP/s) of each base layer's shape at the phase's rows
           as the engine runs it (its forward product x W^T; in training also the input gradient g W, the one
           product a frozen weight's backward makes), and lm_head's at 1,024 rows (the decode profile's bound); the
           large-shape rate is the best of them (a shared machine's noise only ever lowers a rate). From them: the
           model's FLOPs (base products and attention; LoRA counted apart), the time they take at the large-shape rate
           (the bound), the time the base products alone would take at their own shapes' rates, and what they took
           in the step. In training also: what a fresh logits-sized tensor costs beyond writing it (the step makes two).
- rl:      (not in the default phases) training after sampling in one process, as the server runs an RL step: the
           training step of `train` after the `--prompts` long prompts sampled with its adapter (`--rl-tokens` tokens
           each), after the same with the decoder's caches dropped, or alone, in turns; each step's time, its target
           logprobs' time and its page faults, against the step alone in the same round. With `--ab VARIABLE`: the rl
           phase in two processes, VARIABLE=0 and =1 in their environment, taking turns a step at a time (e.g.
           THP_MEM_ALLOC_ENABLE, torch's large buffers on transparent huge pages).

    .venv/bin/python bench/step_profile.py [--phases prefill,train] [--rounds 3] [--prompts 2] [--prompt-tokens 1024]
                                           [--prefill-rank 8] [--batch 8] [--seq 128] [--rank 32]
    .venv/bin/python bench/step_profile.py --phases rl [--rounds 5] [--rl-tokens 16] [--ab THP_MEM_ALLOC_ENABLE]
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time

from benchenv import BASE, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from decode_profile import KINDS, QUESTIONS, Timers, best_of, instrument  # noqa: E402

# Base products grouped as the decode profile's table in docs/performance.md groups them.
GROUPS = {"base q/k/v/o": ("base q_proj", "base k_proj", "base v_proj", "base o_proj"),
          "base gate/up/down": ("base gate_proj", "base up_proj", "base down_proj"),
          "base lm_head": ("base lm_head",)}
FORWARD_PARTS = [*GROUPS, "LoRA products", "attention", "norms", "rotary", "elementwise", "linear layers' Python",
                 "overhead (wall - parts)"]
ANSWER = ("Here is what I would suggest, step by step. First, think about what you already have and what you need. "
          "Second, make a short plan and write it down. Third, try it for a week and see how it goes; adjust as you "
          "learn. Many people find that small, steady changes last longer than big ones.")


def timed_attention(timers: Timers):
    """Time every `attend` the packed forward calls (prefill's and training's attention: cache writes, masks, SDPA) as
    "attention": flat_forward is wrapped where the sampler and the trainer look it up. Returns an undo."""
    from kernel_backend.engine import packed_forward, sampler

    undo = []
    for module in (sampler, packed_forward):
        original = module.flat_forward

        def flat_forward(model, ids, positions, attend, original=original):
            return original(model, ids, positions, timers.wrap(attend, "attention"))
        module.flat_forward = flat_forward
        undo.append(lambda module=module, original=original: setattr(module, "flat_forward", original))
    return lambda: [u() for u in reversed(undo)]


def with_overhead(seconds: dict[str, float], wall: float) -> dict[str, float]:
    """A timed run's parts, base products summed into GROUPS, and the wall time the parts do not cover."""
    out = dict(seconds)
    for group, members in GROUPS.items():
        out[group] = sum(out.pop(m, 0.0) for m in members)
    out["overhead (wall - parts)"] = wall - sum(seconds.values())
    return out


def median_parts(runs: list[dict[str, float]]) -> dict[str, float]:
    """ms, the median over runs, per part."""
    return {part: 1e3 * statistics.median(run.get(part, 0.0) for run in runs) for part in set().union(*runs)}


def print_table(title: str, columns: dict[str, tuple[float, dict[str, float]]], order: list[str]) -> None:
    """Parts' ms and share of each column's whole: columns are {name: (whole ms, {part: ms})}."""
    print(f"\n{title}")
    print(f"  {'part':<44}" + "".join(f"{name:>24}" for name in columns))
    for part in order:
        cells = [f"{ms.get(part, 0.0):10.1f} {100 * ms.get(part, 0.0) / whole:5.1f}%" for whole, ms in columns.values()]
        print(f"  {part:<44}" + "".join(f"{c:>24}" for c in cells))
    print(f"  {'whole (ms)':<44}" + "".join(f"{whole:24.1f}" for whole, _ in columns.values()))


# ---- the floor: product rates at a phase's shapes -----------------------------------------------------------------


def base_layers(engine) -> dict[str, list]:
    """The model's base layers (lora.MultiLoraLinear) by kind (KINDS)."""
    from kernel_backend.engine import lora

    kinds = collections.defaultdict(list)
    for name, layer in lora.lora_layers(engine.model).items():
        kinds[next(k for k in KINDS if name.endswith(k))].append(layer)
    return kinds


def product_rates(engine, rows: int, backward: bool) -> dict:
    """{(kind, "x W^T" or "g W"): GFLOP/s} at `rows` rows, each kind's layers' weights in turn, as a pass meets them:
    the layer's own forward product (MultiLoraLinear.base_product) and, with `backward`, the input gradient as a
    frozen weight's backward computes it (oneDNN's product where the engine's product is oneDNN's, else torch's mm).
    ("lm_head", "x W^T", 1024) is measured whatever `rows` (the decode profile's bound uses it); "large" is the best."""
    from kernel_backend.engine import matmul

    def each(product, operands):
        def run():
            for operand in operands:  # each output dropped before the next, as in a pass (a list of them all would
                product(operand)      # take fresh memory every time: page faults a pass does not have)
        return best_of(run, 3)

    rates = {}
    with torch.no_grad():
        for kind, layers in tqdm(base_layers(engine).items(), desc=f"product rates at {rows} rows", leave=False):
            out_f, in_f = layers[0].base.weight.shape
            flops = 2 * rows * in_f * out_f * len(layers)
            x, g = torch.randn(rows, in_f), torch.randn(rows, out_f)
            rates[kind, "x W^T"] = flops / each(lambda layer: layer.base_product(x), layers) / 1e9
            if backward:
                weights = [layer.base.weight.detach() for layer in layers]
                if layers[0].product is matmul.onednn_linear:
                    rates[kind, "g W"] = flops / each(lambda w: matmul._onednn_linear(g, w.t(), None), weights) / 1e9
                else:
                    rates[kind, "g W"] = flops / each(lambda w: g @ w, weights) / 1e9
        head = base_layers(engine)["lm_head"][0]
        x = torch.randn(1024, head.base.weight.shape[1])
        rates["lm_head", "x W^T", 1024] = 2 * x.numel() * head.base.weight.shape[0] / best_of(lambda: head.base_product(x), 3) / 1e9
    # The large-shape rate: the best any of these products reached (noise on a shared machine only ever lowers a rate).
    rates["large"] = max(rates.values())
    print(f"\n[floor] base products at {rows} rows, GFLOP/s ({torch.get_num_threads()} threads, {load_line()}): " +
          ", ".join(f"{key[0]} {key[1]} {rate:.0f}" for key, rate in rates.items() if len(key) == 2) +
          f"; lm_head x W^T at 1,024 rows {rates['lm_head', 'x W^T', 1024]:.0f}; the large-shape rate (the best of "
          f"them) {rates['large']:.0f}")
    return rates


def model_flops(engine, rows: dict[str, int], attended: int, rank: int) -> dict[str, float]:
    """One forward pass's FLOPs: base products over rows[kind] rows each, attention's two products over `attended`
    (query, key) pairs in all, and LoRA rank `rank` on every target (0: none)."""
    config = engine.model.config
    flops = {"base": 0.0, "lora": 0.0}
    for kind, layers in base_layers(engine).items():
        out_f, in_f = layers[0].base.weight.shape
        flops["base"] += 2 * rows[kind] * in_f * out_f * len(layers)
        flops["lora"] += 2 * rows[kind] * rank * (in_f + out_f) * len(layers)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    flops["attention"] = 2 * 2 * attended * config.num_attention_heads * head_dim * config.num_hidden_layers
    return flops


def at_rates(engine, rows: dict[str, int], rates: dict, layout: str) -> float:
    """Seconds the base products of one pass would take at `rates` (each kind's `layout` rate at its shape)."""
    return sum(2 * rows[kind] * layers[0].base.weight.numel() * len(layers) / (rates[kind, layout] * 1e9)
               for kind, layers in base_layers(engine).items() if rows[kind])


# ---- prefill ------------------------------------------------------------------------------------------------------


def long_prompts(engine, count: int, tokens: int) -> list[list[int]]:
    """`count` multi-turn chats of at least `tokens` tokens (turns added until they reach it), each with its own system
    message so that no two share a prefix the prefix cache would reuse (prefix_cache.MIN_SHARED_TOKENS)."""
    prompts = []
    for i in range(count):
        messages = [{"role": "system", "content": f"Session {i + 1} of {count}. You are a patient, careful assistant."}]
        while True:
            ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
            if len(ids) >= tokens:
                break
            turn = len(messages) // 2
            messages += [{"role": "user", "content": QUESTIONS[(i + turn) % len(QUESTIONS)]},
                         {"role": "assistant", "content": f"({turn}) {ANSWER}"}]
        prompts.append(ids)
    return prompts


def prefill_recorder(timers: Timers | None):
    """Wrap Decoder._prefill: each prefill step's (tokens, lm_head rows, attended (query, key) pairs, wall seconds,
    parts' seconds). Returns (records, undo)."""
    from kernel_backend.engine import sampler

    original, records = sampler.Decoder._prefill, []

    def prefill(self, segments, finished):
        tokens = sum(e - s for _, s, e in segments)
        heads = sum(e == len(a.request.prompt) for a, _, e in segments)  # logits for a finished prompt's last position
        attended = sum((s + 1 + e) * (e - s) // 2 for _, s, e in segments)  # position p sees p + 1 keys
        if timers is not None:
            timers.seconds.clear()
            timers.on = True
        start = time.perf_counter()
        try:
            return original(self, segments, finished)
        finally:
            wall = time.perf_counter() - start
            if timers is not None:
                timers.on = False
            records.append((tokens, heads, attended, wall, dict(timers.seconds) if timers else {}))
    sampler.Decoder._prefill = prefill
    return records, lambda: setattr(sampler.Decoder, "_prefill", original)


def profile_prefill(engine, prompts: list[list[int]], rank: int, rounds: int) -> dict:
    """{side: (plain records, timed records)}: `rounds` rounds after one warm-up, plain and timed runs taking turns."""
    from kernel_backend.types import LoraConfig, SamplingParams

    engine.create_adapter("prefill", LoraConfig(rank=rank, seed=0))
    timers, results = Timers(), {}
    for side, adapter in ((f"LoRA r{rank}", "prefill"), ("base", None)):
        plain, timed = [], []
        for r in tqdm(range(1 + rounds), desc=f"prefill, {side} (round 0 warms up)"):
            for use in (False, True) if r % 2 else (True, False):
                engine.reset_decoder()  # an empty prefix cache: every prompt token is computed
                records, undo_steps = prefill_recorder(timers if use else None)
                undo = [instrument(engine, timers), timed_attention(timers)] if use else []
                try:
                    engine.run_requests([engine.sample_request(adapter, p, 1, SamplingParams(max_tokens=1, seed=i))
                                         for i, p in enumerate(prompts)])
                finally:
                    for u in reversed(undo):
                        u()
                    undo_steps()
                if r:
                    (timed if use else plain).extend(records)
        results[side] = (plain, timed)
    engine.delete_adapter("prefill")
    # The decoders' caches dropped before the next phase, so that it starts as a fresh process would. Kept, they do
    # not slow a training step (the rl phase measures it: docs/performance.md, "Training after sampling").
    engine.reset_decoder()
    gc.collect()
    return results


def report_prefill(engine, results: dict, rank: int, rates: dict, chunk: int) -> None:
    """The parts per 1,000 prompt tokens (steps differ in size and context: sums over them, not medians), and the
    plain runs against the bound."""
    columns, lines = {}, []
    large = rates["large"]
    for side, (plain, timed) in results.items():
        thousands = sum(rec[0] for rec in timed) / 1e3
        runs = [with_overhead(rec[4], rec[3]) for rec in timed]
        parts = {p: 1e3 * sum(run.get(p, 0.0) for run in runs) / thousands for p in set().union(*runs)}
        columns[f"{side}, ms/1k tok"] = (1e3 * sum(rec[3] for rec in timed) / thousands, parts)
        tokens, heads, attended, wall = (sum(rec[i] for rec in plain) for i in range(4))
        rows = {kind: heads if kind == "lm_head" else tokens for kind in KINDS}
        flops = model_flops(engine, rows, attended, rank if side != "base" else 0)
        useful = flops["base"] + flops["attention"]
        products = (parts["base q/k/v/o"] + parts["base gate/up/down"] + parts["base lm_head"]) * tokens / 1e6
        lines.append(
            f"  {side:<8} {tokens} prompt tokens in {len(plain)} steps: {wall:.2f} s, {tokens / wall:.0f} tok/s; model "
            f"FLOPs {useful / 1e9:.1f} G (base products {flops['base'] / 1e9:.1f}, attention {flops['attention'] / 1e9:.1f}; "
            f"LoRA's {flops['lora'] / 1e9:.2f} not counted) at {useful / wall / 1e9:.0f} GFLOP/s = "
            f"**{useful / wall / 1e9 / large:.2f} of the large-shape rate** ({large:.0f}); the bound {useful / large / 1e9:.2f} s; "
            f"base products at their {chunk}-row rates {at_rates(engine, rows, rates, 'x W^T'):.2f} s, in the timed runs "
            f"{products:.2f} s ({flops['base'] / products / 1e9:.0f} GFLOP/s)")
    print_table("[prefill] ms per 1,000 prompt tokens (timed runs: sums over their steps) and share", columns,
                FORWARD_PARTS)
    print(f"\n[prefill] plain runs (no wrappers), {len(results)} sides, all rounds together")
    print("\n".join(lines))


# ---- the training step --------------------------------------------------------------------------------------------

PHASES = ["forward", "loss", "backward", "forward_backward: checks, packing, results", "optim_step: undo copy",
          "optim_step: AdamW", "optim_step: probe forward", "optim_step: step history copy", "optim_step: the rest"]
BACKWARD_PARTS = ["base lm_head", "base layers", "LoRA products", "attention", "loss: softmax gradient",
                  "norms, rotary, elementwise, views", "gradient accumulation", "autograd engine (wall - nodes)"]


class Profiles(list):
    """The timed steps' backward profiles, [(wall seconds, torch.profiler profile)]; `on` during a timed step."""
    on = False


def train_phases(engine, phases: Timers, parts: Timers, profiles: Profiles):
    """Wrap the training step's phases (the docstring's list) in `phases`, always on during a step; turn `parts` on
    inside the forward of a timed step (`profiles.on`), and time the target logprobs there as a part; run a timed
    step's backward under torch.profiler (its profile and wall time appended to `profiles`). Returns an undo."""
    from kernel_backend.engine import core, losses

    undo = []

    def patch(owner, name, timers, part, inner=None):
        original, own = getattr(owner, name), name in vars(owner)  # own: a module's or class's; else an instance's
        setattr(owner, name, timers.wrap(inner(original) if inner else original, part))
        undo.append(lambda: setattr(owner, name, original) if own else delattr(owner, name))

    def forward_parts(original):
        def forward(*args, **kwargs):
            parts.on = profiles.on
            try:
                return original(*args, **kwargs)
            finally:
                parts.on = False
        return forward

    def profiled(original):
        def backward(tensor, *args, **kwargs):
            if not profiles.on:
                return original(tensor, *args, **kwargs)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                start = time.perf_counter()
                original(tensor, *args, **kwargs)
                wall = time.perf_counter() - start
            profiles.append((wall, prof))  # the profiler's own set-up and teardown stay out of `wall`
        return backward

    patch(engine, "forward_backward", phases, "forward_backward: checks, packing, results")
    patch(engine, "_target_logprobs", phases, "forward", forward_parts)
    patch(losses, "target_logprobs", parts, "loss: log_softmax, gather")
    patch(losses, "compute_loss", phases, "loss")
    patch(torch.Tensor, "backward", phases, "backward", profiled)
    patch(engine, "optim_step", phases, "optim_step: the rest")
    patch(core, "_Snapshot", phases, "optim_step: undo copy")
    patch(engine, "_step", phases, "optim_step: AdamW")
    patch(engine, "_unusable", phases, "optim_step: probe forward")
    patch(engine.history, "record", phases, "optim_step: step history copy")
    return lambda: [u() for u in reversed(undo)]


def backward_nodes(profile, vocab: int) -> dict[str, float]:
    """Seconds per part of one backward, from its autograd nodes (the profiler's evaluate_function events, which do not
    nest on a CPU: one thread runs them in turn). A base product's node is lm_head's if its gradient is vocabulary-wide."""
    seconds = collections.defaultdict(float)
    for event in profile.events():
        if not event.name.startswith("autograd::engine::evaluate_function: "):
            continue
        node = event.name.split(": ", 1)[1]
        if node in ("MmBackward0", "AddmmBackward0", "_OneDnnLinearBackward"):
            wide = any(vocab in shape for child in event.cpu_children for shape in child.input_shapes)
            part = "base lm_head" if wide else "base layers"
        elif node == "_AddDeltasBackward":
            part = "LoRA products"
        elif node == "_TargetLogprobsBackward":
            part = "loss: softmax gradient"
        elif "Attention" in node or "ScaledDotProduct" in node:
            part = "attention"
        elif node == "torch::autograd::AccumulateGrad":
            part = "gradient accumulation"
        else:
            part = "norms, rotary, elementwise, views"
            seconds["node " + node] += event.cpu_time_total / 1e6  # which ones: the report lists the largest
        seconds[part] += event.cpu_time_total / 1e6
    return seconds


def profile_train(engine, args) -> dict:
    """Training steps, plain and timed in turns after one warm-up: {"plain": [phases], "timed": [phases],
    "forward": [parts], "backward": [parts]}, seconds."""
    from train_step import Ours, make_batch

    from kernel_backend.types import AdamParams

    ids = make_batch(engine.vocab_size, args.batch, args.seq, seed=0)
    ours = Ours(engine, args.rank, ids, [args.seq] * args.batch, AdamParams(learning_rate=1e-4))
    phases, parts, profiles = Timers(), Timers(), Profiles()
    undo = [instrument(engine, parts), timed_attention(parts), train_phases(engine, phases, parts, profiles)]
    results = collections.defaultdict(list)
    try:
        for r in tqdm(range(1 + 2 * args.rounds), desc="training steps (step 0 warms up; then plain, timed in turns)"):
            profiles.on = r % 2 == 0 and r > 0
            phases.seconds.clear()
            parts.seconds.clear()
            phases.on = True
            start = time.perf_counter()
            ours.step()
            wall = time.perf_counter() - start
            phases.on = False
            if r == 0:
                continue
            kind = "timed" if profiles.on else "plain"
            results[kind].append({**phases.seconds, "step": wall})
            if profiles.on:
                results["forward"].append(with_overhead(parts.seconds, phases.seconds["forward"]))
                backward_wall, prof = profiles.pop()
                nodes = backward_nodes(prof, engine.vocab_size)
                parts_only = sum(t for part, t in nodes.items() if not part.startswith("node "))
                results["backward"].append({**nodes, "autograd engine (wall - nodes)": backward_wall - parts_only,
                                            "wall": backward_wall})
    finally:
        for u in reversed(undo):
            u()
    engine.delete_adapter(ours.adapter)
    return results


def report_train(engine, results: dict, args, rates: dict) -> None:
    tokens = args.batch * args.seq
    plain, timed = median_parts(results["plain"]), median_parts(results["timed"])
    print_table(f"[train] the step by phase, ms (median over {len(results['plain'])} plain and {len(results['timed'])} "
                "timed steps) and share", {"plain steps": (plain["step"], plain), "timed steps": (timed["step"], timed)},
                PHASES)
    forward = median_parts(results["forward"])
    backward = median_parts(results["backward"])
    print_table("[train] the forward by part (timed steps), ms", {"forward": (timed["forward"], forward)},
                [*FORWARD_PARTS, "loss: log_softmax, gather"])
    print_table("[train] the backward by autograd node (timed steps, under torch.profiler), ms",
                {"backward": (backward["wall"], backward)}, BACKWARD_PARTS)
    nodes = sorted((t, part[5:]) for part, t in backward.items() if part.startswith("node "))[::-1][:8]
    print("  its norms, rotary, elementwise, views, by node: " + ", ".join(f"{node} {t:.0f}" for t, node in nodes))

    # What a fresh logits-sized tensor costs beyond writing it (the step makes two: lm_head's output, log_softmax's):
    # its pages are new to the process each time (glibc maps blocks this large afresh), and each is faulted in.
    shape = (tokens, engine.vocab_size)
    reused = torch.empty(shape)
    fresh_ms, reused_ms = (1e3 * best_of(fn, 3) for fn in (lambda: torch.empty(shape).fill_(1.0), lambda: reused.fill_(1.0)))
    print(f"  a fresh {4 * tokens * engine.vocab_size / 1e6:.0f} MB tensor filled: {fresh_ms:.0f} ms; the same tensor "
          f"refilled: {reused_ms:.0f} ms")

    # The bound: forward and backward FLOPs (a frozen weight's backward is its input gradient alone: one product as
    # large as the forward's; attention's backward ~2x its forward) at the large-shape rate.
    rows = {kind: tokens for kind in KINDS}
    flops = model_flops(engine, rows, args.batch * args.seq * (args.seq + 1) // 2, args.rank)
    base, attention, lora_flops = 2 * flops["base"], 3 * flops["attention"], 3 * flops["lora"]
    large = rates["large"]
    bound = (base + attention) / (large * 1e9)
    products_in_step = (forward["base q/k/v/o"] + forward["base gate/up/down"] + forward["base lm_head"]
                        + backward["base lm_head"] + backward["base layers"]) / 1e3
    shapes = at_rates(engine, rows, rates, "x W^T") + at_rates(engine, rows, rates, "g W")
    step = plain["step"] / 1e3
    print(f"\n[train] {args.batch} x {args.seq} = {tokens} tokens, LoRA rank {args.rank}: forward + backward "
          f"{(base + attention) / tokens / 1e9:.3f} GFLOP a token (base products {base / tokens / 1e9:.3f}, attention "
          f"{attention / tokens / 1e9:.3f}; LoRA's {lora_flops / tokens / 1e9:.3f} not counted)")
    print(f"  the bound at the large-shape rate ({large:.0f} GFLOP/s): {bound:.2f} s a step, {tokens / bound:.0f} tokens/s")
    print(f"  measured (plain steps, median): {step:.2f} s a step, {tokens / step:.0f} tokens/s = **{bound / step:.2f} of "
          f"the bound**; forward_backward alone {(step - sum(plain[p] for p in PHASES if p.startswith('optim')) / 1e3):.2f} s")
    print(f"  base products alone at their own shapes' rates ({tokens} rows, x W^T and g W): {shapes:.2f} s "
          f"({base / shapes / 1e9:.0f} GFLOP/s); in the timed steps {products_in_step:.2f} s "
          f"({base / products_in_step / 1e9:.0f} GFLOP/s); everything else in the step {step - products_in_step:.2f} s")


# ---- an RL step: sampling, then training, in one process -----------------------------------------------------------

# What precedes each training step of the rl phase, taking turns: the rollouts (the long prompts sampled), as the
# server runs an RL step; the rollouts, then the decoder's caches dropped and collected; or nothing.
RL_CONDITIONS = ("sampled", "sampled, caches dropped", "not sampled")


def rl_iterations(engine, args, wait=lambda: None):
    """`--rounds` rounds after one warm-up (round 0) of the rl phase: in each, one training step (forward_backward +
    optim_step, `--batch` x `--seq`) after each of RL_CONDITIONS, in turns (the order reversed every other round).
    Yields a record per step: round, condition, seconds of the sampling, the step and its target logprobs, the step's
    minor page faults (a fresh tensor of 32 MB or more is a block glibc maps anew, faulted in a page at a time), the
    torch threads at the step's start, and the loss. `wait()` is called before each step's sampling (--ab's
    sides wait there for their turn)."""
    import resource

    from train_step import Ours, make_batch

    from kernel_backend.engine import losses
    from kernel_backend.types import AdamParams, SamplingParams

    prompts = long_prompts(engine, args.prompts, args.prompt_tokens)
    ours = Ours(engine, args.rank, make_batch(engine.vocab_size, args.batch, args.seq, seed=0), [args.seq] * args.batch,
                AdamParams(learning_rate=1e-4))
    timers = Timers()
    original, losses.target_logprobs = losses.target_logprobs, timers.wrap(losses.target_logprobs, "logprobs")
    try:
        for r in range(1 + args.rounds):
            for condition in RL_CONDITIONS if r % 2 == 0 else RL_CONDITIONS[::-1]:
                wait()
                start = time.perf_counter()
                if condition != "not sampled":
                    # With the run's own adapter, as RL samples: its weights change every step, so the prefix
                    # cache never serves these prompts and every rollout prefills them whole.
                    engine.run_requests([engine.sample_request(ours.adapter, p, 1, SamplingParams(
                        max_tokens=args.rl_tokens, seed=r)) for p in prompts])
                if condition == "sampled, caches dropped":
                    engine.reset_decoder()
                    gc.collect()
                sampled, threads = time.perf_counter(), torch.get_num_threads()
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                timers.seconds.clear()
                timers.on = True
                loss = ours.step()
                timers.on = False
                yield {"round": r, "condition": condition, "sample": sampled - start,
                       "step": time.perf_counter() - sampled, "logprobs": timers.seconds["logprobs"],
                       "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, "threads": threads,
                       "loss": loss}
    finally:
        losses.target_logprobs = original
        engine.delete_adapter(ours.adapter)


def report_rl(records: list[dict], label, against: str, pair) -> None:
    """Median ms (faults: count) of each `label(record)` group, and the median of the ratios of each record to the
    `against` group's record with the same `pair(record)` (> 1: higher than `against`). Round 0, the warm-up, left out."""
    records = [rec for rec in records if rec["round"]]
    groups = collections.defaultdict(list)
    for rec in records:
        groups[label(rec)].append(rec)
    base = {pair(rec): rec for rec in groups[against]}
    for key in ("step", "logprobs", "faults"):
        cells = []
        for name, recs in groups.items():
            scale = 1 if key == "faults" else 1e3
            cell = f"{name}: {scale * statistics.median(rec[key] for rec in recs):.0f}"
            if name != against:
                ratios = [rec[key] / base[pair(rec)][key] for rec in recs if pair(rec) in base]
                cell += f" (x{statistics.median(ratios):.2f}, {sum(x > 1 for x in ratios)} of {len(ratios)} higher)"
            cells.append(cell)
        print(f"  {key + (' (count)' if key == 'faults' else ' (ms)'):<16} " + "; ".join(cells))


def profile_rl(engine, args) -> None:
    """The rl phase in this process: each step's record as it comes, then each condition against the step alone in
    the same round. With --turns (--ab's sides), each step waits for a line on stdin and its record goes to stdout as
    a JSON line, for the parent to compare."""
    import json
    import sys

    if args.turns:
        for rec in rl_iterations(engine, args, wait=sys.stdin.readline):
            print(json.dumps(rec), flush=True)
        return
    records = []
    for rec in rl_iterations(engine, args):
        records.append(rec)
        print(f"  round {rec['round']} {rec['condition']:<24} sampling {rec['sample']:5.2f} s, step {rec['step']:5.2f} s, "
              f"target logprobs {1e3 * rec['logprobs']:4.0f} ms, {rec['faults']} page faults, {rec['threads']} threads "
              f"| {load_line()}", flush=True)
    if records:
        print(f"\n[rl] {args.rounds} rounds after one warm-up: a rank-{args.rank} step on {args.batch} x {args.seq} after "
              f"{args.prompts} prompts of {args.prompt_tokens}+ tokens sampled ({args.rl_tokens} tokens each), after "
              "the same with the decoder's caches dropped, or alone; medians, and the median ratio to the step alone "
              "in the same round")
        report_rl(records, lambda rec: rec["condition"], "not sampled", lambda rec: rec["round"])
        print(f"  torch threads at a step's start: {sorted({rec['threads'] for rec in records})}")


def ab(args) -> None:
    """The rl phase in two processes of this script, `--ab`=0 (before) and =1 (after) in their environment (e.g.
    THP_MEM_ALLOC_ENABLE: torch's buffers of 2 MB and more on transparent huge pages), taking turns a step at a time,
    so that both see the machine's load alike: medians, the median of the pairs' ratios, and whether the losses are
    bit-identical (the sides run the same steps: they must be)."""
    import json
    import os
    import subprocess
    import sys

    command = [sys.executable, __file__, "--phases", "rl", "--turns", *(f"--{k.replace('_', '-')}={v}" for k, v in
               vars(args).items() if k in ("rounds", "prompts", "prompt_tokens", "batch", "seq", "rank", "rl_tokens"))]
    sides = {name: subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, args.ab: value})
             for name, value in (("before", "0"), ("after", "1"))}
    records = []
    for step in tqdm(range((1 + args.rounds) * len(RL_CONDITIONS)), desc=f"steps, {args.ab}=0 and =1 in turns"):
        for name in ("before", "after") if step % 2 else ("after", "before"):
            side = sides[name]
            side.stdin.write("go\n")
            side.stdin.flush()
            while not (line := side.stdout.readline()).startswith("{"):  # the engine's own output passes through
                if not line:
                    raise SystemExit(f"the {name} side ended early")
                print(f"  [{name}] {line.rstrip()}")
            records.append({**json.loads(line), "side": name})
    for side in sides.values():
        side.stdin.close()
        side.wait()
    print(f"\n[rl --ab] {args.ab}=0 (before) against =1 (after), {args.rounds} rounds of {len(RL_CONDITIONS)} steps a "
          "side after one warm-up; medians, and the median ratio after / before (< 1: after is faster)")
    report_rl(records, lambda rec: rec["side"], "before", lambda rec: (rec["round"], rec["condition"]))
    losses = {side: [rec["loss"] for rec in records if rec["side"] == side] for side in ("before", "after")}
    print(f"  losses bit-identical on both sides, every step: {losses['before'] == losses['after']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="prefill,train")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--prefill-rank", type=int, default=8, help="the LoRA side of prefill (the RL recipes' rank)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32, help="the training step's LoRA rank (bench/train_step.py's)")
    parser.add_argument("--rl-tokens", type=int, default=16, help="the rl phase: tokens sampled per prompt")
    parser.add_argument("--ab", metavar="VARIABLE", help="the rl phase with VARIABLE=0 against =1 in the environment, "
                        "in two processes taking turns (e.g. THP_MEM_ALLOC_ENABLE; see `ab`)")
    parser.add_argument("--turns", action="store_true", help=argparse.SUPPRESS)  # --ab's sides: wait for stdin
    args = parser.parse_args()
    if args.ab:
        return ab(args)
    phases = args.phases.split(",")

    from kernel_backend.engine.core import Engine

    print(f"{time.strftime('%Y-%m-%d %H:%M')} {load_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    engine = Engine(BASE)
    assert next(engine.model.parameters()).dtype == torch.float32, "float32 expected"
    assert type(engine.decoder).__name__ == "Decoder", engine.decoder
    if "prefill" in phases:
        prompts = long_prompts(engine, args.prompts, args.prompt_tokens)
        chunk = engine.settings.prefill_chunk_tokens
        print(f"\n==== prefill: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, chunks of {chunk}")
        results = profile_prefill(engine, prompts, args.prefill_rank, args.rounds)
        report_prefill(engine, results, args.prefill_rank, product_rates(engine, chunk, backward=False), chunk)
        print(load_line())
    if "train" in phases:
        print(f"\n==== train: {args.batch} x {args.seq} tokens, LoRA rank {args.rank}, AdamW")
        results = profile_train(engine, args)
        report_train(engine, results, args, product_rates(engine, args.batch * args.seq, backward=True))
        print(load_line())
    if "rl" in phases:
        profile_rl(engine, args)


if __name__ == "__main__":
    main()
