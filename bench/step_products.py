"""Why a bf16 decode step's base products run slower inside the step than alone (issue 54; docs/performance.md, "Why a
step's products run slower than the products alone").

The engine with bf16 sampling copies (STEPWISE_SAMPLE_DTYPE=bfloat16, engine/lora.py), the real default model; the
base products of one decode step at `--rows` rows (30 layers x q|k|v, o, gate|up, down, then lm_head: 121 products,
~270 MB of prepacked bf16 weights), each as the engine makes it (`lora._copy_product`: the float32 input cast to bf16,
oneDNN's product on the prepacked copy, the output cast back), under the thread counts the engine gives it
(`small_products.small`: one thread under 2^23 multiply-adds). Each figure is a wall time and the process's CPU time
(both threads, time.process_time): on a shared machine the difference is the time spent waiting for a core.

- step:     real decode steps of `--rows` rows (the base model): their products' time (each call timed), and the
            same products replayed right after each step, in order and each on one weight of its shape
- products: the step's products run seven ways, taking turns round by round:
              alone      each kind repeated on one weight (it stays in cache: what a microbenchmark measures)
              by kind    each kind through its 30 layers' weights in turn
              in order   the step's order, every layer's own weight (weights come from memory); also with every
                         thread, with one thread, in bf16 only (no casts), with a one-thread op between products
                         (a step's norms, rotary, attention), with 8 MB written between products
            and the memory's read rate (a torch sum over 1 GiB, every thread)
- threads:  decode steps alternating between every thread (small products on one) and one thread for the whole step
- casts:    decode steps alternating between the engine's products and the same with their casts on one thread

    .venv/bin/python bench/step_products.py [--parts products,step,threads,casts] [--rows 32] [--rounds 15]
    OMP_WAIT_POLICY=ACTIVE .venv/bin/python bench/step_products.py --parts step     # spinning workers (before torch loads)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchenv import BASE, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--parts", default="products,step")
    args = parser.parse_args()

    from kernel_backend.engine import lora, small_products
    from kernel_backend.engine.core import Engine

    print(f"{time.strftime('%Y-%m-%d %H:%M')} {load_line()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, GOMP_SPINCOUNT="
          f"{os.environ.get('GOMP_SPINCOUNT')}", flush=True)
    engine = Engine(BASE)
    lora.sample_weights(engine.model, "bfloat16")
    rows = args.rows
    step = bf16_products(engine.model)
    weight_bytes = sum(_shape(layer)[0] * _shape(layer)[1] * 2 for layer in _copies(engine.model))
    inputs = {n: torch.randn(rows, n) for n in {in_f for _, _, in_f, _ in step}}
    inputs16 = {n: x.bfloat16() for n, x in inputs.items()}
    scratch = torch.zeros(1 << 21)  # 8 MB: the other ops' traffic between products

    def product(weight, in_f, out_f, x):
        with small_products.small(rows * in_f * out_f):
            return lora._copy_product(x, weight, None)

    small_op = torch.randn(rows, 576)

    def run(order, call, between: str = "") -> tuple[float, float]:
        """The products' own wall time and the process's CPU time in them (each call timed, whatever runs between)."""
        total = cpu = 0.0
        for _, weight, in_f, out_f in order:
            start, cpu_start = time.perf_counter(), time.process_time()
            call(weight, in_f, out_f)
            total += time.perf_counter() - start
            cpu += time.process_time() - cpu_start
            if between == "traffic":
                scratch.add_(1.0)
            elif between == "one-thread op":  # what a step's norms, rotary and attention do: small ops on one thread
                with small_products.small(0):
                    small_op.mul_(1.0)
        return total, cpu

    def engine_call(weight, in_f, out_f):
        product(weight, in_f, out_f, inputs[in_f])

    def fixed_call(weight, in_f, out_f):
        lora._copy_product(inputs[in_f], weight, None)

    def bf16_call(weight, in_f, out_f):
        with small_products.small(rows * in_f * out_f):
            bf16_product(inputs16[in_f], weight)

    def one_thread(order, call):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run(order, call)
        finally:
            torch.set_num_threads(threads)

    firsts = {}  # one weight of each kind: the first layer's, lm_head's own
    for item in step:
        firsts.setdefault(item[0], item)
    counts = {kind: sum(1 for k, *_ in step if k == kind) for kind in firsts}
    repeated = [item for kind, item in firsts.items() for _ in range(counts[kind])]  # the same products, one weight each
    by_kind = sorted(step, key=lambda item: list(firsts).index(item[0]))  # each kind through its 30 weights in turn
    ways = {
        "alone: each kind repeated on one weight": lambda: run(repeated, engine_call),
        "by kind: each kind through its 30 weights": lambda: run(by_kind, engine_call),
        "in order (the step's; engine's threads)": lambda: run(step, engine_call),
        "in order, every thread": lambda: run(step, fixed_call),
        "in order, one thread": lambda: one_thread(step, fixed_call),
        "in order, bf16 only (no casts)": lambda: run(step, bf16_call),
        "in order + a one-thread op between": lambda: run(step, engine_call, "one-thread op"),
        "in order + 8 MB written between": lambda: run(step, engine_call, "traffic"),
    }
    flops = sum(2 * rows * in_f * out_f for _, _, in_f, out_f in step)
    if "step" in args.parts:
        in_step(engine, rows, args.rounds, product)
    if "threads" in args.parts:
        one_thread_steps(engine, rows, args.rounds)
    if "casts" in args.parts:
        casts_steps(engine, args.rounds)
    if "products" not in args.parts:
        return
    for fn in ways.values():  # warm up
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            times[name].append(fn())
    print(f"\n{rows} rows, {len(step)} products, {flops / 1e9:.2f} GFLOP, {weight_bytes / 1e6:.0f} MB of bf16 weights a "
          f"step; the products' own time, medians of {args.rounds} rounds (each round runs every way once)")
    base = statistics.median(t for t, _ in times[next(iter(ways))])
    for name, ts in times.items():
        t, cpu = statistics.median(t for t, _ in ts), statistics.median(c for _, c in ts)
        print(f"  {name:<44} {1e3 * t:6.1f} ms  {flops / t / 1e9:6.0f} GFLOP/s  ({t / base:.2f}x alone); CPU time "
              f"{1e3 * cpu:6.1f} ms", flush=True)
    big = torch.ones(1 << 28)  # 1 GiB
    big.sum()
    reads = []
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        reads.append(time.perf_counter() - start)
    rate = big.nbytes / min(reads)
    print(f"  memory: torch sum of 1 GiB, every thread: {rate / 1e9:.1f} GB/s; the step's weights at it: "
          f"{weight_bytes / rate * 1e3:.1f} ms")
    print(load_line())


def in_step(engine, rows: int, rounds: int, product) -> None:
    """The base products' own time inside real decode steps against the same products replayed right after each step
    (the same weights in the same order, the same row count, nothing in between), and replayed each on one weight."""
    from decode_profile import workload
    from kernel_backend.engine import lora, sampler

    original_product, original_decode = lora._copy_product, sampler.Decoder._decode
    calls: list = []  # (weight, input shape, seconds) of the current step's products

    def timed_product(x2d, weight, bias):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return original_product(x2d, weight, bias)
        finally:
            calls.append((weight, x2d.shape, time.perf_counter() - start, time.process_time() - cpu))

    results = []  # (in the step, replayed in order, replayed alone, step wall, products, their CPU time, replayed's,
    #               the step's CPU time)

    def decode(self, finished):
        calls.clear()
        start, step_cpu = time.perf_counter(), time.process_time()
        try:
            return original_decode(self, finished)
        finally:
            wall, step_cpu = time.perf_counter() - start, time.process_time() - step_cpu
            if len(self.rows) == rows:
                recorded = list(calls)
                inside = sum(t for *_, t, _ in recorded)
                inside_cpu = sum(c for *_, c in recorded)
                replay = replay_cpu = 0.0
                for weight, shape, *_ in recorded:
                    x = torch.randn(shape)
                    t0, c0 = time.perf_counter(), time.process_time()
                    product(weight, shape[1], weight.shape[0], x)
                    replay += time.perf_counter() - t0
                    replay_cpu += time.process_time() - c0
                # Each product on the first weight of its shape, as often as the step makes it (weights in cache)
                firsts: dict = {}
                alone = 0.0
                for weight, shape, *_ in recorded:
                    first = firsts.setdefault((tuple(weight.shape), shape), weight)
                    x = torch.randn(shape)
                    t0 = time.perf_counter()
                    product(first, shape[1], first.shape[0], x)
                    alone += time.perf_counter() - t0
                results.append((inside, replay, alone, wall, len(recorded), inside_cpu, replay_cpu, step_cpu))

    lora._copy_product, sampler.Decoder._decode = timed_product, decode
    try:
        for r in range(max(1, rounds // 5)):
            engine.run_requests(workload(engine, None, rows, 40, seed=100 * r))
    finally:
        lora._copy_product, sampler.Decoder._decode = original_product, original_decode
    inside, replay, alone, wall, count, inside_cpu, replay_cpu, step_cpu = (statistics.median(column) for column in zip(*results))
    print(f"\n[step] {len(results)} decode steps of {rows} rows (base model, bf16 copies), {count:.0f} products a step; "
          f"medians: step {1e3 * wall:.1f} ms (the process's CPU time in it {1e3 * step_cpu:.1f} ms), its base products {1e3 * inside:.1f} ms; the same products replayed "
          f"right after the step in order {1e3 * replay:.1f} ms ({inside / replay:.2f}x), each on one weight "
          f"{1e3 * alone:.1f} ms ({inside / alone:.2f}x); the process's CPU time (both threads) in the products: in the "
          f"step {1e3 * inside_cpu:.1f} ms, replayed {1e3 * replay_cpu:.1f} ms", flush=True)


def ab_steps(engine, rounds: int, label: str, names: tuple[str, str], use, row_counts=(32,)) -> None:
    """Decode steps alternating between two ways (`use(False)`: names[0], the baseline; `use(True)`: names[1]) on the
    same rows, a rank-8 LoRA on every target and the base model: medians of wall and CPU time (from one step's start
    to the next's), and of the adjacent pairs' ratios (names[0]'s step / names[1]'s)."""
    from decode_profile import alternating, workload
    from kernel_backend.types import LoraConfig

    engine.create_adapter("ab", LoraConfig(rank=8, seed=0))
    try:
        for side, adapter in (("LoRA r8", "ab"), ("base", None)):
            for rows in row_counts:
                cpu: list[float] = []

                def mark(on: bool) -> None:
                    use(on)
                    cpu.append(time.process_time())

                steps = alternating(engine, lambda r: workload(engine, adapter, rows, 40, seed=100 * r),
                                    max(1, rounds // 5), (False, True), mark)
                use(False)
                cpu.append(time.process_time())
                marks = [b - a for a, b in zip(cpu, cpu[1:])]
                full = [(on, t, c) for (n, on, t), c in zip(steps[2:], marks[2:]) if n == rows]
                ratios = [a[1] / b[1] for a, b in zip(full, full[1:]) if not a[0] and b[0]]
                cpu_ratios = [a[2] / b[2] for a, b in zip(full, full[1:]) if not a[0] and b[0]]
                cells = [f"{name} {1e3 * statistics.median(t for o, t, _ in full if o == on):.1f} ms (CPU "
                         f"{1e3 * statistics.median(c for o, _, c in full if o == on):.1f})" for on, name in enumerate(names)]
                print(f"[{label}] {side:<8} {rows} rows: " + ", ".join(cells) + f"; {names[0]} / {names[1]}: wall "
                      f"{statistics.median(ratios):.2f}, CPU {statistics.median(cpu_ratios):.2f} ({len(ratios)} pairs); "
                      f"{load_line()}", flush=True)
    finally:
        engine.delete_adapter("ab")


def one_thread_steps(engine, rows: int, rounds: int) -> None:
    """Every thread for a decode step (small products on one thread, larger ones on every thread: engine/small_products.py;
    the engine's way) against one thread for the whole step (tried 2026-12-06 for bf16 copies, not kept:
    docs/performance.md)."""
    threads = torch.get_num_threads()
    ab_steps(engine, rounds, "threads", ("every thread", "one thread"),
             lambda one: torch.set_num_threads(1 if one else threads), (16, rows))


def casts_steps(engine, rounds: int) -> None:
    """The sampling copies' products as the engine makes them (`lora._copy_product`: the input's cast to bf16 and the
    output's back under the product's threads, both where it has both) against the same with the casts on one thread
    (`small_products.small` by elements): tried 2026-12-06, not kept (docs/performance.md)."""
    from kernel_backend.engine import lora, small_products

    engine_product = lora._copy_product

    def casts_on_one_thread(x2d, weight, bias):
        with small_products.small(x2d.numel()):
            x = x2d.to(weight.dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        with small_products.small(out.numel()):
            return out.to(x2d.dtype)

    def use(on: bool) -> None:
        lora._copy_product = casts_on_one_thread if on else engine_product

    ab_steps(engine, rounds, "casts", ("casts on the product's threads", "on one thread"), use, (16, 32))
    lora._copy_product = engine_product


def bf16_products(model) -> list[tuple[str, torch.Tensor, int, int]]:
    """A bf16 decode step's base products in the step's order, as (kind, weight, in_features, out_features): each layer's
    q|k|v (stacked), o, gate|up (stacked), down, then lm_head, on the sampler's prepacked copies (lora.sample_weights)."""
    step = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for kind, copy in (("q|k|v", attention.q_proj.shared_copy), ("o", attention.o_proj),
                           ("gate|up", mlp.gate_proj.shared_copy), ("down", mlp.down_proj)):
            weight = copy.sample_weight if isinstance(copy, torch.nn.Module) else copy.weight
            assert weight.dtype == torch.bfloat16 and weight.is_mkldnn, (kind, weight.dtype)
            step.append((kind, weight, *reversed(_shape(copy))))
    head = model.lm_head
    step.append(("lm_head", head.sample_weight, *reversed(_shape(head))))
    return step


def bf16_product(x16: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """lora._copy_product without its casts: x16 already bf16, the output left bf16."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x16, weight, None, "none", [], "")
    return torch.nn.functional.linear(x16, weight)


def _shape(copy) -> tuple[int, int]:
    """(out_features, in_features) of a layer's or a shared copy's product."""
    if isinstance(copy, torch.nn.Module):
        return tuple(copy.base.weight.shape)  # type: ignore[return-value]
    return sum(copy.sizes), copy.layers[0].base.weight.shape[1]


def _copies(model):
    from kernel_backend.engine import lora

    seen = set()
    for layer in lora.lora_layers(model).values():
        copy = layer.shared_copy if layer.shared_copy is not None else layer
        if id(copy) not in seen:
            seen.add(id(copy))
            yield copy


if __name__ == "__main__":
    main()
