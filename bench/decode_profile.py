"""Where a decode step's time goes, and how far it is from the machine's floor (issue 54's first item), in
float32 and with the sampler's bfloat16 weights (STEPWISE_SAMPLE_DTYPE, engine/lora.py), and the sampler/trainer
logprob gap that costs.

Five parts, in one run:

- profile: the built-in sampler's own code path (engine.run_requests -> Decoder.step -> Decoder._decode, in
           this process, the real default model SmolLM2-135M-Instruct in float32), decode steps of exactly 1,
           16 and 32 live rows (1 request x 1 sample; 4 x 4; 8 x 4; temperature 1, a seed each), once with
           a LoRA adapter (rank 8, every target: the RL recipe's default, workbench/recipes/common.py) and
           once on the base model alone; all of it once per sampling dtype (--sample-dtypes: float32 first, the
           baseline, then bfloat16 on the same engine, its copies made in between). Each part of a step is timed by wrapping the functions the step
           calls (no product code changes; the wrappers go around module attributes, only while a
           decode step runs, prefill not counted), as exclusive time (a part's own time, its timed
           children's taken out):
             base products  each MultiLoraLinear's frozen product (its `base_product`; in bf16 the input's and
                            output's casts included), by layer kind
                            (q/k/v/o, gate/up/down, lm_head); in bf16 q|k|v and gate|up are one stacked product
                            each (lora.SharedCopy.product)
             linear Python  MultiLoraLinear.forward less its products: small_products.small's
                            thread switch, the routing lookup, reshapes
             LoRA products  engine/lora.py add_deltas
             attention      the decode step's attend (cache writes + SDPA over the cache)
             norms          families.norm;  rotary: families.rotate + the model's rotary_emb
             elementwise    the MLP's act(gate) * up, q/k/v views, embedding, logits' .float()
             sampling       _choose_for: logsumexp over the 49,152 logits, the draw (sampler.choose), the gather
             overhead       the step's wall time minus the parts: per-layer Python, dispatch, routing, bookkeeping
           The step's wall time is also measured with no wrappers (steps of the same row count, same
           workload), which is what tokens/s is computed from; the wrappers' own cost is the difference.
- floor:   memory bandwidth (a 1 GiB numpy copy on one thread, a torch copy and a torch sum on every thread); the
           product rate (GFLOP/s) of (rows x 576) @ (576 x 49152) in float32 (torch's F.linear and the
           engine's own base product) and bfloat16 at 1, 16, 32 and 1024 rows, and of the model's other
           linear shapes at 16 and 32 rows (as the engine runs them: small products on one thread), and of
           q/k/v and gate/up concatenated into one weight each (a fused product, not the engine's today);
           from them the fp32 compute bound of decoded tokens/s (the 1024-row lm_head rate over 2 x params
           FLOPs a token), against which the measured tokens/s at 32 rows of each dtype is printed as a ratio,
           and bf16's step time against float32's (the same run).
- pairs:   the step time of each sampling dtype against float32's where the machine is shared and its load drifts:
           the bf16 copies made, decode steps alternate between them and the float32 weights (lora.sampling
           switched off for every other step; the same rows, the same cache), so each bf16 step has a float32
           step beside it under the same load. Medians of each and of the adjacent pairs' ratios, at 1, 16 and
           32 rows, LoRA r8 and base; the 32 rows' tokens/s against the fp32 bound when floor runs too.
- gap:     what bf16 sampling costs in agreement with the trainer, on RL-like samples: 8 chat prompts x 4
           samples, temperature 1, up to 64 tokens, from the base model and from a rank-8 adapter whose B is
           random (so its deltas count), sampled in each dtype. For every sampled token: the sampler's logprob
           against the trainer's (Engine.forward, float32): mean and max |difference|, and the mean of
           (sampler - trainer), the k1 estimate of KL(sampler || trainer) that RL recipes log as
           kl_sample_train; and the exact KL(sampler || trainer) over the whole vocabulary at each sampled
           position (the model run on the samples with and without the sampling copies).

- targets: issue 54's done-when, in one run: the fp32 bound (the floor part's), the step's base products alone at 32
           rows (each of the model's weights once, in the step's order, read from memory as a step reads them; and
           each kind repeated on one weight, cache-resident: what a microbenchmark times) in float32 (the engine's
           own product) and in bfloat16 (the prepacked stacked copies, inputs already bf16, no casts), each as the
           decoded tokens/s it would allow if a step were nothing else; then decode through the official tinker SDK
           at 32 rows (8 requests x 4 samples, exactly --tokens tokens each: stop=[], the base model, as the issue
           measured it) against two servers, float32 and STEPWISE_SAMPLE_DTYPE=bfloat16, rounds alternating; every
           rate as a fraction of the same fp32 bound.

    .venv/bin/python bench/decode_profile.py --parts targets --tokens 64 --rounds 3

    .venv/bin/python bench/decode_profile.py [--parts profile,floor,pairs,gap] [--sample-dtypes float32,bfloat16]
                                             [--tokens 40] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from benchenv import BASE, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

QUESTIONS = [
    "What is your favorite color?", "How are you today?", "What should I eat for dinner?", "Tell me about dogs.",
    "What is the weather like in spring?", "Can you recommend a book?", "What is a good hobby?",
    "How do I stay healthy?",
]
WORKLOADS = {1: (1, 1), 16: (4, 4), 32: (8, 4)}  # rows -> (requests, samples each)
KINDS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


# ---- profile: exclusive timers around the decode step's functions -------------------------------------------


class Timers:
    """Exclusive seconds per part, only while `on` (inside Decoder._decode)."""

    def __init__(self) -> None:
        self.on = False
        self.stack: list[float] = []  # children's seconds of each open timer
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, fn, part):
        """fn timed as `part` (a name, or a function of fn's arguments giving one)."""
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = self.stack.pop()
                name = part if isinstance(part, str) else part(*args)
                self.seconds[name] += elapsed - children
                if self.stack:
                    self.stack[-1] += elapsed
        return timed


def instrument(engine, timers: Timers):
    """Wrap the decode step's parts (module attributes and the model's modules); returns an undo."""
    from kernel_backend.engine import families, lora, sampler

    undo = []

    def patch(owner, name, part):
        original = getattr(owner, name)
        setattr(owner, name, timers.wrap(original, part))
        undo.append(lambda: setattr(owner, name, original))

    patch(lora.MultiLoraLinear, "forward", "linear layers' Python")  # their products are timed children
    for name, layer in lora.lora_layers(engine.model).items():  # each frozen product (an attribute of the instance)
        kind = next(k for k in KINDS if name.endswith(k))
        layer.base_product = timers.wrap(layer.base_product, "base " + kind)
        undo.append(lambda layer=layer: layer.__dict__.pop("base_product"))  # the class's method again
    # bf16 sampling: q|k|v and gate|up share one stacked copy and product (lora.products), timed as its own kind.
    patch(lora.SharedCopy, "product", lambda copy, x: "base " + "|".join(n.rsplit(".", 1)[-1][:-5] for n in
                                                                         (layer.name for layer in copy.layers)))
    patch(lora.MultiLoraLinear, "plus_deltas", "linear layers' Python")  # its LoRA products are timed children
    patch(lora, "add_deltas", "LoRA products")
    patch(families, "norm", "norms")
    patch(families, "rotate", "rotary")
    patch(families, "feed_forward", "elementwise")  # its products are timed children: what is left is act(gate) * up
    patch(families, "projections", "elementwise")  # views
    patch(sampler, "_choose_for", "sampling: logsumexp, gather")
    patch(sampler, "choose", "sampling: draw")
    patch(sampler.Decoder, "_logits", "elementwise")  # lm_head's product is a child: .float(), final_logits
    inner = engine.model.model
    patch(inner.rotary_emb, "forward", "rotary")
    patch(inner.embed_tokens, "forward", "elementwise")

    original_attention = sampler.Decoder._decode_attention

    def decode_attention(self, *args, **kwargs):
        return timers.wrap(original_attention(self, *args, **kwargs), "attention")
    sampler.Decoder._decode_attention = decode_attention
    undo.append(lambda: setattr(sampler.Decoder, "_decode_attention", original_attention))
    return lambda: [u() for u in reversed(undo)]


def step_recorder(timers: Timers | None):
    """Wrap Decoder._decode: each step's (rows, wall seconds, parts' seconds); returns (records, undo)."""
    from kernel_backend.engine import sampler

    original = sampler.Decoder._decode
    records = []

    def decode(self, finished):
        rows = len(self.rows)
        if timers is not None:
            timers.seconds.clear()
            timers.on = True
        start = time.perf_counter()
        try:
            return original(self, finished)
        finally:
            wall = time.perf_counter() - start
            if timers is not None:
                timers.on = False
            records.append((rows, wall, dict(timers.seconds) if timers else {}))
    sampler.Decoder._decode = decode
    return records, lambda: setattr(sampler.Decoder, "_decode", original)


def workload(engine, adapter, rows: int, tokens: int, seed: int):
    from kernel_backend.types import SamplingParams

    requests, samples = WORKLOADS[rows]
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                                    add_generation_prompt=True)["input_ids"] for i in range(requests)]
    return [engine.sample_request(adapter, p, samples, SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed + i))
            for i, p in enumerate(prompts)]


def profile(engine, tokens: int, rounds: int, dtypes: list[str]) -> dict:
    """{dtype: {(side, rows): (plain step ms, timed step ms, {part: ms})}}, medians over the steps of exactly `rows`
    live rows. The dtypes take turns within each round (on a shared machine the load drifts: alternating keeps
    their ratio fair)."""
    from kernel_backend.types import LoraConfig

    engine.create_adapter("profile", LoraConfig(rank=8, seed=0))
    timers = Timers()
    results = {dtype: {} for dtype in dtypes}
    for side, adapter in (("LoRA r8", "profile"), ("base", None)):
        for rows in WORKLOADS:
            runs = {dtype: ([], [], collections.defaultdict(list)) for dtype in dtypes}  # plain, timed, parts
            for r in range(rounds):
                for dtype in dtypes:
                    use_sample_dtype(engine, dtype, quiet=True)
                    plain, timed, parts = runs[dtype]
                    for use in (False, True):  # alternate: plain steps, then timed steps
                        records, undo_steps = step_recorder(timers if use else None)
                        undo = instrument(engine, timers) if use else (lambda: None)
                        try:
                            engine.run_requests(workload(engine, adapter, rows, tokens, seed=100 * r))
                        finally:
                            undo()
                            undo_steps()
                        full = [rec for rec in records if rec[0] == rows][1:]  # the first step warms up
                        for _, wall, seconds in full:
                            (timed if use else plain).append(wall)
                            if use:
                                for part in set(seconds) | set(parts):
                                    parts[part].append(seconds.get(part, 0.0))
                                parts["overhead (wall - parts)"].append(wall - sum(seconds.values()))
            for dtype, (plain, timed, parts) in runs.items():
                ms = {p: 1e3 * statistics.median(v) for p, v in parts.items()}
                result = (1e3 * statistics.median(plain), 1e3 * statistics.median(timed), ms, len(plain), len(timed))
                results[dtype][side, rows] = result
                print(f"  {dtype:<8} {side:<8} {rows:>2} rows: step {result[0]:.1f} ms plain ({len(plain)} steps), "
                      f"{result[1]:.1f} ms timed ({len(timed)} steps)", flush=True)
    engine.delete_adapter("profile") if hasattr(engine, "delete_adapter") else None
    return results


def print_profile(results: dict, dtype: str) -> None:
    order = [*(f"base {k}" for k in KINDS), "base q|k|v", "base gate|up", "LoRA products", "attention", "norms", "rotary", "elementwise",
             "sampling: logsumexp, gather", "sampling: draw", "linear layers' Python", "overhead (wall - parts)"]
    for side in ("LoRA r8", "base"):
        print(f"\n[profile] {side}, sampling weights {dtype}: ms per decode step (median) and share of the timed step")
        print(f"  {'part':<30}" + "".join(f"{str(rows) + ' rows':>18}" for rows in WORKLOADS))
        for part in order:
            cells = []
            for rows in WORKLOADS:
                _, timed, ms, *_ = results[side, rows]
                value = ms.get(part, 0.0)
                cells.append(f"{value:8.2f} {100 * value / timed:5.1f}%   ")
            print(f"  {part:<30}" + "".join(f"{c:>18}" for c in cells))
        print(f"  {'step, timed (sum of medians may differ)':<30}" +
              "".join(f"{results[side, rows][1]:14.2f} ms " for rows in WORKLOADS))
        print(f"  {'step, no wrappers':<30}" + "".join(f"{results[side, rows][0]:14.2f} ms " for rows in WORKLOADS))
        print(f"  {'tokens/s, no wrappers':<30}" + "".join(f"{rows / results[side, rows][0] * 1e3:14.1f}    " for rows in WORKLOADS))


# ---- floor: bandwidth and product rates ----------------------------------------------------------------------


def best_of(fn, repeat: int, seconds: float = 0.5) -> float:
    """The median seconds of fn() over repeats (at least `repeat`, up to `seconds` of work)."""
    fn()
    times, spent = [], 0.0
    while len(times) < repeat or spent < seconds:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
        if len(times) >= 200:
            break
    return statistics.median(times)


def floor(engine) -> float:
    """Prints the floor measurements; returns the fp32 bound in tokens/s."""
    from kernel_backend.engine import small_products

    print(f"\n[floor] {torch.get_num_threads()} torch threads")
    a = np.ones(1 << 27, dtype=np.float64)  # 1 GiB
    b = np.empty_like(a)
    t = best_of(lambda: np.copyto(b, a), 5)
    print(f"  memory: numpy copy of 1 GiB (one thread): {a.nbytes / t / 1e9:.1f} GB/s read "
          f"({2 * a.nbytes / t / 1e9:.1f} GB/s read + write)")
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    t = best_of(lambda: tb.copy_(ta), 5)
    print(f"  memory: torch copy of 1 GiB ({torch.get_num_threads()} threads): {a.nbytes / t / 1e9:.1f} GB/s read "
          f"({2 * a.nbytes / t / 1e9:.1f} GB/s read + write)")
    t = best_of(lambda: ta.sum(), 5)
    print(f"  memory: torch sum of 1 GiB ({torch.get_num_threads()} threads, read only): {a.nbytes / t / 1e9:.1f} GB/s")
    read_rate = a.nbytes / t
    a = b = ta = tb = None  # the 2 GiB back before the products below (a `del` would hide the names' uses)

    head = engine.model.lm_head
    engine_product = head.product
    weight32 = head.base.weight.detach()
    weight16 = weight32.to(torch.bfloat16)
    print(f"  lm_head product (rows x 576) @ (576 x 49152), GFLOP/s (ms), every thread; engine's product: "
          f"{getattr(engine_product, '__name__', engine_product)}")
    rates = {}
    for rows in (1, 16, 32, 1024):
        x32 = torch.randn(rows, 576)
        cells = []
        for name, fn in (("fp32 F.linear", lambda: F.linear(x32, weight32)),
                         ("fp32 engine", lambda: engine_product(x32, weight32, None)),
                         ("bf16 F.linear", lambda x16=x32.bfloat16(): F.linear(x16, weight16))):
            t = best_of(fn, 5)
            rates[name, rows] = 2 * rows * 576 * 49152 / t / 1e9
            cells.append(f"{name} {rates[name, rows]:6.1f} ({1e3 * t:6.2f} ms)")
        print(f"    {rows:>4} rows: " + ",  ".join(cells))
    print("  other base shapes (30 layers' weights in turn, cold), fp32 engine product as the engine runs it "
          "(small products on one thread), GFLOP/s; bf16 F.linear beside it")
    layers = engine.model.model.layers
    def weight(module):
        return module.base.weight.detach()
    for kind, get in (("q/o 576->576", lambda layer: weight(layer.self_attn.q_proj)),
                      ("k/v 576->192", lambda layer: weight(layer.self_attn.k_proj)),
                      ("gate/up 576->1536", lambda layer: weight(layer.mlp.gate_proj)),
                      ("down 1536->576", lambda layer: weight(layer.mlp.down_proj)),
                      # not what the engine runs today: q/k/v and gate/up as one product each (issue 54's idea)
                      ("q|k|v 576->960", lambda layer: torch.cat([weight(layer.self_attn.q_proj), weight(layer.self_attn.k_proj),
                                                              weight(layer.self_attn.v_proj)])),
                      ("gate|up 576->3072", lambda layer: torch.cat([weight(layer.mlp.gate_proj), weight(layer.mlp.up_proj)]))):
        weights = [get(layer) for layer in layers]
        weights16 = [w.bfloat16() for w in weights]
        out_f, in_f = weights[0].shape
        cells = []
        for rows in (16, 32):
            x = torch.randn(rows, in_f)
            x16 = x.bfloat16()

            def run32():
                with small_products.small(rows * in_f * out_f):
                    for w in weights:
                        engine_product(x, w, None)

            def run16():
                with small_products.small(rows * in_f * out_f):
                    for w in weights16:
                        F.linear(x16, w)
            flops = 2 * rows * in_f * out_f * len(weights)
            cells.append(f"{rows} rows fp32 {flops / best_of(run32, 5) / 1e9:6.1f}, bf16 {flops / best_of(run16, 5) / 1e9:6.1f}")
        print(f"    {kind:<18} " + ";  ".join(cells))
    params = sum(p.numel() for p in engine.model.parameters())
    peak = max(rates["fp32 F.linear", 1024], rates["fp32 engine", 1024])
    bound = peak * 1e9 / (2 * params)
    print(f"  params {params / 1e6:.1f} M (lm_head tied to the embedding): 2 x params = {2 * params / 1e9:.3f} GFLOP a token;"
          f" fp32 bound at {peak:.1f} GFLOP/s (lm_head, 1024 rows): {bound:.0f} decoded tokens/s")
    print(f"  weights' bytes a step: fp32 {4 * params / 1e6:.0f} MB: {4 * params / read_rate * 1e3:.1f} ms at the read-only rate"
          f" (bf16: {2 * params / read_rate * 1e3:.1f} ms)")
    return bound


# ---- targets: issue 54's done-when, against the floor of the products themselves ------------------------------


def products_floor(engine, rows: int = 32) -> dict[str, float]:
    """Seconds of a decode step's base products alone at `rows` rows (no attention, norms, LoRA or Python between):
    {"float32 in order", "float32 cache-resident", "bfloat16 in order", "bfloat16 cache-resident"}. float32: every
    base layer's own product as the engine makes it (MultiLoraLinear.base_product, small products on one thread);
    bfloat16: the sampler's prepacked copies, q|k|v and gate|up stacked, the input already bf16 and the output left
    bf16 (the casts a step makes around them are not counted)."""
    from kernel_backend.engine import lora, small_products
    from step_products import bf16_product, bf16_products

    layers = engine.model.model.layers
    fp32 = [m for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                            layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                            layer.mlp.down_proj)] + [engine.model.lm_head]
    lora.sample_weights(engine.model, "bfloat16")
    bf16 = bf16_products(engine.model)  # (kind, weight, in_features, out_features), q|k|v and gate|up stacked
    inputs = {n: torch.randn(rows, n) for n in {m.base.weight.shape[1] for m in fp32}}
    inputs16 = {n: x.bfloat16() for n, x in inputs.items()}

    def run_fp32(modules):
        for m in modules:
            out_f, in_f = m.base.weight.shape
            with small_products.small(rows * in_f * out_f):
                m.base_product(inputs[in_f])

    def run_bf16(items):
        for _, weight, in_f, out_f in items:
            with small_products.small(rows * in_f * out_f):
                bf16_product(inputs16[in_f], weight)

    def repeated(items, key):  # the same products, each on the first weight of its kind: cache-resident
        firsts: dict = {}
        return [firsts.setdefault(key(item), item) for item in items]

    ways = {"float32 in order": lambda: run_fp32(fp32),
            "float32 cache-resident": lambda r=repeated(fp32, lambda m: m.name.rsplit(".", 1)[-1]): run_fp32(r),
            "bfloat16 in order": lambda: run_bf16(bf16),
            "bfloat16 cache-resident": lambda r=repeated(bf16, lambda item: item[0]): run_bf16(r)}
    try:
        return {name: best_of(fn, 9, seconds=2.0) for name, fn in ways.items()}
    finally:
        lora.sample_weights(engine.model, "float32")


def sdk_decode(tokens: int, rounds: int) -> dict[str, float]:
    """Sampled tokens/s through the official SDK at 32 rows: 8 requests x 4 samples of exactly `tokens` tokens (stop=[])
    from four base-model samplers, on a float32 server and a STEPWISE_SAMPLE_DTYPE=bfloat16 one, rounds alternating."""
    from sample import Sessions, start
    from workbench.recipes.common import local_tokenizer

    tokenizer = local_tokenizer(BASE)
    servers = {}
    try:
        for dtype in ("float32", "bfloat16"):
            servers[dtype] = start("batched", "float32", dtype)
        sessions = {dtype: Sessions(server, tokenizer, lora=False) for dtype, server in servers.items()}
        for s in sessions.values():
            s.round(max_tokens=2)  # warm-up: first use of each sampler
        seconds: dict[str, list[float]] = {dtype: [] for dtype in servers}
        sampled: dict[str, int] = {}
        for i in range(rounds):
            for dtype in list(servers) if i % 2 == 0 else reversed(list(servers)):
                elapsed, results = sessions[dtype].round(max_tokens=tokens, stop=[])
                seconds[dtype].append(elapsed)
                sampled[dtype] = sum(len(seq.tokens) for r in results for seq in r.sequences)
        return {dtype: sampled[dtype] / statistics.median(s) for dtype, s in seconds.items()}
    finally:
        for server in servers.values():
            server.stop()


def targets(engine, tokens: int, rounds: int) -> None:
    bound = floor(engine)
    params = sum(p.numel() for p in engine.model.parameters())
    print(f"\n[targets] the step's base products alone at 32 rows, {2 * params * 32 / 1e9:.2f} GFLOP; best of >= 9 runs")
    floors = products_floor(engine)
    for name, t in floors.items():
        rate = 32 / t
        print(f"  {name:<24} {1e3 * t:6.1f} ms  {2 * params * 32 / t / 1e9:6.0f} GFLOP/s  -> at most {rate:6.0f} tok/s "
              f"if a step were nothing else = {rate / bound:.2f} of the fp32 bound", flush=True)
    print(f"  ({load_line()})")
    rates = sdk_decode(tokens, rounds)
    print(f"\n[targets] decode through the SDK at 32 rows (8 requests x 4 samples x exactly {tokens} tokens, base "
          f"model, median of {rounds} rounds, alternating)")
    for dtype, goal in (("float32", 0.6), ("bfloat16", 1.2)):
        floor_rate = 32 / floors[f"{dtype} in order"]
        print(f"  {dtype:<9} {rates[dtype]:6.1f} tok/s = {rates[dtype] / bound:.2f} of the fp32 bound ({bound:.0f}); "
              f"issue 54 asks >= {goal} ({goal * bound:.0f} tok/s); its products alone allow {floor_rate / bound:.2f}")
    print(f"  bfloat16 / float32 through the SDK: {rates['bfloat16'] / rates['float32']:.2f}x   ({load_line()})")


# ---- the sampling dtype, and the gap it opens to the trainer ---------------------------------------------------


def use_sample_dtype(engine, dtype: str, quiet: bool = False) -> None:
    """The engine's sampler on `dtype` weights from now on (what STEPWISE_SAMPLE_DTYPE sets at start-up); a fresh
    decoder, so that no prefix cached in the other dtype is reused."""
    from kernel_backend.engine import lora

    copies = lora.sample_weights(engine.model, dtype)
    engine.reset_decoder()
    if not quiet:
        print(f"\n==== sampling weights: {dtype} (copies: {copies / 1e6:.0f} MB; Engine.memory's sampler_weights_bytes "
              f"{engine.memory()['sampler_weights_bytes'] / 1e6:.0f} MB)", flush=True)


def alternating(engine, requests, rounds: int, kinds: tuple, use) -> list[tuple]:
    """Decode steps taking turns among `kinds` on the same rows: `use(kind)` sets each step up (inside the step, after
    Decoder.step's own set-up). `requests(round)` are run `rounds` times. Returns [(live rows, kind, seconds)]."""
    from kernel_backend.engine import sampler

    original, steps = sampler.Decoder._decode, []

    def decode(self, finished):
        kind = kinds[len(steps) % len(kinds)]
        use(kind)
        start = time.perf_counter()
        try:
            return original(self, finished)
        finally:
            steps.append((len(self.rows), kind, time.perf_counter() - start))
    sampler.Decoder._decode = decode
    try:
        for r in range(rounds):
            engine.run_requests(requests(r))
    finally:
        sampler.Decoder._decode = original
    return steps


def pairs(engine, dtype: str, tokens: int, rounds: int) -> dict:
    """{(side, rows): (float32 step ms, `dtype` step ms, median of the pairs' float32/dtype ratios, pairs)}, decode
    steps alternating between the sampling copies and the float32 weights (see the docstring)."""
    from kernel_backend.types import LoraConfig

    use_sample_dtype(engine, dtype, quiet=True)
    engine.create_adapter("pairs", LoraConfig(rank=8, seed=0))
    routing = engine.model._stepwise_routing
    results = {}
    print(f"\n[pairs] decode steps alternating float32 / {dtype} weights (medians; ratio: float32 step / {dtype} step, "
          "the median over adjacent pairs)")
    for side, adapter in (("LoRA r8", "pairs"), ("base", None)):
        for rows in WORKLOADS:
            # Decoder.step turned lora.sampling on; off every other step: the float32 weights.
            steps = alternating(engine, lambda r: workload(engine, adapter, rows, tokens, seed=100 * r), rounds,
                                (False, True), lambda on: setattr(routing, "sampling", on))
            full = [(on, t) for n, on, t in steps[2:] if n == rows]  # the first pair warms up
            ratios = [a[1] / b[1] for a, b in zip(full, full[1:]) if not a[0] and b[0]]
            fp32 = 1e3 * statistics.median(t for on, t in full if not on)
            low = 1e3 * statistics.median(t for on, t in full if on)
            results[side, rows] = (fp32, low, statistics.median(ratios), len(ratios))
            print(f"  {side:<8} {rows:>2} rows: float32 {fp32:6.1f} ms, {dtype} {low:6.1f} ms, ratio "
                  f"{results[side, rows][2]:.2f} ({len(ratios)} pairs); tokens/s {rows / fp32 * 1e3:.1f} -> "
                  f"{rows / low * 1e3:.1f}", flush=True)
    engine.delete_adapter("pairs")
    use_sample_dtype(engine, "float32", quiet=True)
    return results


def gap(engine, dtypes: list[str], tokens: int = 64) -> None:
    """The sampler's logprobs against the trainer's on RL-like samples, per sampling dtype (see the docstring)."""
    from kernel_backend.engine import lora
    from kernel_backend.types import Datum, LoraConfig, SamplingParams

    engine.create_adapter("gap-fresh", LoraConfig(rank=8, seed=1))  # B = 0: an RL run's first step
    engine.create_adapter("gap-trained", LoraConfig(rank=8, seed=2))
    generator = torch.Generator().manual_seed(0)
    for _, b in engine._slot("gap-trained").adapter.weights.values():
        b.data.normal_(0.0, 0.002, generator=generator)  # deltas the size of a few hundred RL steps' (a guess)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in QUESTIONS]
    print(f"\n[gap] sampler vs trainer (Engine.forward, float32), {len(prompts)} prompts x 4 samples, temperature 1, "
          f"max {tokens} tokens")
    for dtype in dtypes:
        use_sample_dtype(engine, dtype)
        for adapter_id in ("gap-fresh", "gap-trained"):
            adapter = engine._slot(adapter_id).adapter
            requests = [engine.sample_request(adapter_id, p, 4, SamplingParams(max_tokens=tokens, temperature=1.0, seed=7 + i))
                        for i, p in enumerate(prompts)]
            diffs, kls = [], []
            for prompt, result in zip(prompts, engine.run_requests(requests)):
                for seq in result.sequences:
                    full = prompt + seq.tokens
                    trainer = engine.forward(adapter_id, [Datum(full[:-1], {"target_tokens": np.array(full[1:])})])
                    trained = trainer.loss_fn_outputs[0]["logprobs"][len(prompt) - 1:]
                    diffs.append(np.asarray(seq.logprobs, dtype=np.float64) - trained)
                    # The whole distribution at each sampled position: the model with and without the sampling copies.
                    ids = torch.tensor([full[:-1]])
                    with torch.inference_mode(), lora.route(engine.model, [adapter]):
                        train = engine.model(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)
                        with lora.sampling(engine.model):
                            sample = engine.model(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)
                    kls.append((sample.exp() * (sample - train)).sum(-1).clamp_min(0).numpy())
            d, kl = np.concatenate(diffs), np.concatenate(kls)
            print(f"  {dtype:<8} {adapter_id:<11} {len(d)} tokens: |sampler - trainer| mean {np.abs(d).mean():.2e} max "
                  f"{np.abs(d).max():.2e}; mean(sampler - trainer) (kl_sample_train's k1) {d.mean():+.2e}; exact "
                  f"KL(sampler || trainer) mean {kl.mean():.2e} a token, max {kl.max():.2e}", flush=True)
    engine.delete_adapter("gap-fresh")
    engine.delete_adapter("gap-trained")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="profile,pairs,floor,gap")
    parser.add_argument("--sample-dtypes", default="float32,bfloat16", help="float32 first: the baseline")
    parser.add_argument("--tokens", type=int, default=40, help="max_tokens a sample")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    parts, dtypes = args.parts.split(","), args.sample_dtypes.split(",")

    from kernel_backend.engine.core import Engine

    print(f"{time.strftime('%Y-%m-%d %H:%M')} {load_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    engine = Engine(BASE)
    assert next(engine.model.parameters()).dtype == torch.float32, "float32 expected"
    assert type(engine.decoder).__name__ == "Decoder", engine.decoder
    results = {}
    if "profile" in parts:
        results = profile(engine, args.tokens, args.rounds, dtypes)
        for dtype in dtypes:
            print_profile(results[dtype], dtype)
    paired = pairs(engine, dtypes[-1], args.tokens, 2 * args.rounds) if "pairs" in parts else None
    bound = floor(engine) if "floor" in parts else None
    if paired and bound:
        for side in ("LoRA r8", "base"):
            fp32, low, ratio, _ = paired[side, 32]
            print(f"  [pairs] 32 rows, {side}: float32 {32 / fp32 * 1e3:.1f} tok/s = {32 / fp32 * 1e3 / bound:.2f} of the "
                  f"fp32 bound ({bound:.0f}); {dtypes[-1]} {32 / low * 1e3:.1f} tok/s = {32 / low * 1e3 / bound:.2f}")
    if results:
        first = dtypes[0]
        print(f"\n[summary] decode steps, no wrappers, medians; each dtype's step time against {first}'s (same run)")
        for dtype in dtypes:
            for side in ("LoRA r8", "base"):
                cells = [f"{rows} rows {results[dtype][side, rows][0]:6.1f} ms "
                         f"({results[first][side, rows][0] / results[dtype][side, rows][0]:.2f}x)" for rows in WORKLOADS]
                rate = 32 / results[dtype][side, 32][0] * 1e3
                ratio = f" = {rate / bound:.2f} of the fp32 bound ({bound:.0f})" if bound else ""
                print(f"  {dtype:<8} {side:<8} " + ", ".join(cells) + f"; 32 rows {rate:.1f} tok/s{ratio}")
    if "gap" in parts:
        gap(engine, dtypes)
    if "targets" in parts:
        targets(engine, args.tokens, args.rounds)
    print(load_line())


if __name__ == "__main__":
    main()
