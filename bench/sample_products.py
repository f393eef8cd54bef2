"""The sampler's bf16 products as the engine runs them today against how they ran before, decode step by decode step.

With STEPWISE_SAMPLE_DTYPE=bfloat16 each base layer keeps a bf16 copy of its weight for the sampler (engine/lora.py).
Two things changed how the sampler multiplies by it: on a CPU with oneDNN the copy is prepacked, reordered once into
oneDNN's blocked layout (`lora._prepacked`) instead of on every product; and the layers read from one input (q, k, v
and gate, up) share one stacked copy, one product for them where there were three and two (`lora.products`). This
script builds the real default model's engine with the copies, keeps a plain bf16 copy of every weight beside them,
and runs the built-in sampler's own decode steps (Engine.run_requests, in process) with three kinds of base products
taking turns, step by step, on the same rows:

- float32:     the trainer's own weights (lora.sampling off for the step): the baseline;
- bf16 plain:  the bf16 copy as the engine used it before: each layer's own, F.linear (torch.mv for a lone row);
- bf16 packed: the engine's own path today.

Steps alternate, so each kind sees the same load on a shared machine; medians over the steps of exactly 1, 16 and 32
live rows (bench/decode_profile.py's workloads: temperature 1, up to 40 tokens, a rank-8 LoRA on every target and the
base model alone), each against float32's. It also prints how far the two bf16 paths' logprobs are apart (the
stacked products may round differently).

    .venv/bin/python bench/sample_products.py [--rounds 3]

`--parts compare` (2026-12-06, the step after): the bf16 decode step as it was that morning against today's, two
decoders on one engine taking turns step by step on the same requests (both with the bf16 copies):
- before: a float32 KV cache (attention over it in float32), each layer adding its own LoRA deltas;
- today:  the cache and attention in bf16 (Decoder.cache_dtype), each adapter's deltas on a stacked q|k|v or
          gate|up product as one pair of products (lora.SharedCopy.plus_deltas).
Medians of the steps of exactly 16 and 32 live rows and of the adjacent pairs' ratios (before / today). And the
draw's vocabulary-wide ops at 32 rows as they were (a division by temperature 1, softmax, cumsum into a new tensor)
against today's (no division, cumsum in place), alternating.

    .venv/bin/python bench/sample_products.py --parts compare [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchenv import BASE, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import torch  # noqa: E402

from decode_profile import WORKLOADS, alternating, workload  # noqa: E402

KINDS = ("float32", "bf16 plain", "bf16 packed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="paths", help="paths (float32 / bf16 plain / bf16 packed), compare")
    args = parser.parse_args()
    if args.parts == "compare":
        return compare(args.rounds)

    from kernel_backend.engine import lora
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import LoraConfig

    print(f"{time.strftime('%Y-%m-%d %H:%M')} {load_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    engine = Engine(BASE)
    lora.sample_weights(engine.model, "bfloat16")
    engine.reset_decoder()
    layers = list(lora.lora_layers(engine.model).values())
    packed = [(layer.sample_weight, layer.shared_copy) for layer in layers]
    assert all((w if w is not None else shared.weight).is_mkldnn for w, shared in packed), \
        "no prepacked copies: this CPU build has no oneDNN"
    plain = [layer.base.weight.detach().to(torch.bfloat16).contiguous() for layer in layers]
    routing = engine.model._stepwise_routing
    engine.create_adapter("r8", LoraConfig(rank=8, seed=0))

    def use(kind: str) -> None:
        routing.sampling = kind != "float32"  # Decoder.step turned it on; off: the float32 weights
        for layer, p, (q, shared) in zip(layers, plain, packed):
            layer.sample_weight, layer.shared_copy = (p, None) if kind == "bf16 plain" else (q, shared)

    # The same rows through both bf16 paths.
    logprobs = {}
    for kind in KINDS[1:]:
        use(kind)
        routing.sampling = False  # the sampler's passes turn it on
        engine.reset_decoder()  # no prefix cached by the other layout
        requests = workload(engine, "r8", 16, 16, seed=5)
        logprobs[kind] = [s.logprobs for result in engine.run_requests(requests) for s in result.sequences]
    use("bf16 packed")
    routing.sampling = False
    gaps = [abs(a - b) for x, y in zip(logprobs["bf16 plain"], logprobs["bf16 packed"]) for a, b in zip(x, y)]
    print(f"bf16 plain vs packed, the same requests: {sum(gaps) / len(gaps):.1e} mean |logprob difference|, max "
          f"{max(gaps):.1e} (over {len(gaps)} tokens while the samples agree)")

    for side, adapter in (("LoRA r8", "r8"), ("base", None)):
        for rows in WORKLOADS:
            try:
                steps = alternating(engine, lambda r: workload(engine, adapter, rows, 40, seed=100 * r), args.rounds,
                                    KINDS, use)
            finally:
                use("bf16 packed")
            timed = [(kind, t) for n, kind, t in steps[len(KINDS):] if n == rows]  # the first turn warms up
            ms = {kind: 1e3 * statistics.median(t for k, t in timed if k == kind) for kind in KINDS}
            print(f"  {side:<8} {rows:>2} rows: " + ", ".join(
                f"{kind} {ms[kind]:6.1f} ms ({ms['float32'] / ms[kind]:.2f}x, {rows / ms[kind] * 1e3:.0f} tok/s)"
                for kind in KINDS), flush=True)
    print(load_line())


def compare(rounds: int) -> None:
    """The bf16 decode step before and after the 2026-12-06 changes, steps alternating (see the docstring)."""
    from kernel_backend.engine import lora, sampler
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import LoraConfig

    print(f"{time.strftime('%Y-%m-%d %H:%M')} {load_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    engine = Engine(BASE)
    lora.sample_weights(engine.model, "bfloat16")
    engine.create_adapter("r8", LoraConfig(rank=8, seed=0))
    stacked_deltas = lora.SharedCopy.plus_deltas

    def decoder(cache_dtype):
        engine.reset_decoder()
        d = engine.decoder
        d.cache_dtype = cache_dtype
        d.cache = sampler.KVCache(d.cache.shape[0], d.kv_heads, d.head_dim, cache_dtype, d.cache.device, d.budget_tokens)
        return d

    original, timed = sampler.Decoder._decode, {}

    def decode(self, finished):
        start = time.perf_counter()
        try:
            return original(self, finished)
        finally:
            timed[id(self)] = (len(self.rows), time.perf_counter() - start)
    sampler.Decoder._decode = decode
    try:
        for side, adapter in (("LoRA r8", "r8"), ("base", None)):
            for rows in (16, 32):
                pairs = []
                for r in range(rounds):
                    before, today = decoder(torch.float32), decoder(torch.bfloat16)
                    for d in (before, today):
                        for request in workload(engine, adapter, rows, 40, seed=100 * r):
                            d.admit(request)
                    while before.busy and today.busy:
                        timed.clear()
                        lora.SharedCopy.plus_deltas = lambda self, x, out: False  # each layer its own deltas
                        before.step()
                        lora.SharedCopy.plus_deltas = stacked_deltas
                        today.step()
                        if all(timed.get(id(d), (0,))[0] == rows for d in (before, today)):
                            pairs.append((timed[id(before)][1], timed[id(today)][1]))
                pairs = pairs[1:]  # the first warms up
                ms = [1e3 * statistics.median(p[i] for p in pairs) for i in (0, 1)]
                ratio = statistics.median(a / b for a, b in pairs)
                print(f"  {side:<8} {rows:>2} rows: before {ms[0]:6.1f} ms, today {ms[1]:6.1f} ms "
                      f"({rows / ms[1] * 1e3:.0f} tok/s); before / today {ratio:.3f} (median of {len(pairs)} pairs)",
                      flush=True)
    finally:
        sampler.Decoder._decode = original
        lora.SharedCopy.plus_deltas = stacked_deltas
    logits, ops = torch.randn(32, 49152) * 4, {"before": [], "today": []}
    for _ in range(50 * rounds):
        for kind, run in (("before", lambda: (logits / 1.0).softmax(-1).cumsum(-1)),
                          ("today", lambda: logits.softmax(-1).cumsum_(-1))):
            start = time.perf_counter()
            run()
            ops[kind].append(time.perf_counter() - start)
    ratio = statistics.median(a / b for a, b in zip(ops["before"], ops["today"]))
    print(f"  the draw's ops at 32 x 49,152: before {1e3 * statistics.median(ops['before']):.2f} ms, today "
          f"{1e3 * statistics.median(ops['today']):.2f} ms, before / today {ratio:.2f}")
    print(load_line())


if __name__ == "__main__":
    main()
