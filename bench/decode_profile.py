"""Where a decode step's time goes, and how far it is from the machine's floor (issue 54's first item).

Two parts, in one run:

- profile: the built-in sampler's own code path (engine.run_requests -> Decoder.step -> Decoder._decode, in
           this process, the real default model SmolLM2-135M-Instruct in float32), decode steps of exactly 1,
           16 and 32 live rows (1 request x 1 sample; 4 x 4; 8 x 4; temperature 1, a seed each), once with
           a LoRA adapter (rank 8, every target: the RL recipe's default, workbench/recipes/common.py) and
           once on the base model alone. Each part of a step is timed by wrapping the functions the step
           calls (no product code changes; the wrappers go around module attributes, only while a
           decode step runs, prefill not counted), as exclusive time (a part's own time, its timed
           children's taken out):
             base products  each MultiLoraLinear's frozen product (its `product`), by layer kind
                            (q/k/v/o, gate/up/down, lm_head)
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
           FLOPs a token), against which the measured tokens/s at 32 rows is printed as a ratio.

    .venv/bin/python bench/decode_profile.py [--parts profile,floor] [--tokens 40] [--rounds 2]
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
    for name, layer in lora.lora_layers(engine.model).items():  # each frozen product (the instance's own attribute)
        kind = next(k for k in KINDS if name.endswith(k))
        patch(layer, "product", "base " + kind)
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


def profile(engine, tokens: int, rounds: int) -> dict:
    """{(side, rows): (plain step ms, timed step ms, {part: ms})}, medians over the steps of exactly `rows` live rows."""
    from kernel_backend.types import LoraConfig

    engine.create_adapter("profile", LoraConfig(rank=8, seed=0))
    timers = Timers()
    results = {}
    for side, adapter in (("LoRA r8", "profile"), ("base", None)):
        for rows in WORKLOADS:
            plain, timed, parts = [], [], collections.defaultdict(list)
            for r in range(rounds):
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
            ms = {p: 1e3 * statistics.median(v) for p, v in parts.items()}
            results[side, rows] = (1e3 * statistics.median(plain), 1e3 * statistics.median(timed), ms, len(plain), len(timed))
            print(f"  {side:<8} {rows:>2} rows: step {results[side, rows][0]:.1f} ms plain ({len(plain)} steps), "
                  f"{results[side, rows][1]:.1f} ms timed ({len(timed)} steps)", flush=True)
    engine.delete_adapter("profile") if hasattr(engine, "delete_adapter") else None
    return results


def print_profile(results: dict) -> None:
    order = [*(f"base {k}" for k in KINDS), "LoRA products", "attention", "norms", "rotary", "elementwise",
             "sampling: logsumexp, gather", "sampling: draw", "linear layers' Python", "overhead (wall - parts)"]
    for side in ("LoRA r8", "base"):
        print(f"\n[profile] {side}: ms per decode step (median) and share of the timed step")
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
    del a, b, ta, tb

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
    for kind, get in (("q/o 576->576", lambda l: weight(l.self_attn.q_proj)),
                      ("k/v 576->192", lambda l: weight(l.self_attn.k_proj)),
                      ("gate/up 576->1536", lambda l: weight(l.mlp.gate_proj)),
                      ("down 1536->576", lambda l: weight(l.mlp.down_proj)),
                      # not what the engine runs today: q/k/v and gate/up as one product each (issue 54's idea)
                      ("q|k|v 576->960", lambda l: torch.cat([weight(l.self_attn.q_proj), weight(l.self_attn.k_proj),
                                                              weight(l.self_attn.v_proj)])),
                      ("gate|up 576->3072", lambda l: torch.cat([weight(l.mlp.gate_proj), weight(l.mlp.up_proj)]))):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="profile,floor")
    parser.add_argument("--tokens", type=int, default=40, help="max_tokens a sample")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    parts = args.parts.split(",")

    from kernel_backend.engine.core import Engine

    print(f"{time.strftime('%Y-%m-%d %H:%M')} {load_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    engine = Engine(BASE)
    assert next(engine.model.parameters()).dtype == torch.float32, "float32 expected"
    assert type(engine.decoder).__name__ == "Decoder", engine.decoder
    results = profile(engine, args.tokens, args.rounds) if "profile" in parts else None
    if results:
        print_profile(results)
    bound = floor(engine) if "floor" in parts else None
    if results and bound:
        for side in ("LoRA r8", "base"):
            rate = 32 / results[side, 32][0] * 1e3
            print(f"  32 rows, {side}: {rate:.1f} decoded tokens/s (decode steps, no wrappers) = "
                  f"{rate / bound:.2f} of the fp32 bound ({bound:.0f})")
    print(load_line())


if __name__ == "__main__":
    main()
