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
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
