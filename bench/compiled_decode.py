"""What a compiled bf16 decode step would give (issue 54's next step), measured before building it into the engine.

The engine's bf16 decode step at 32 rows spends ~2/3 of its time outside the base products (docs/performance.md, "Issue
54's targets, measured in one run"): casts, norms, rotary, attention, LoRA, per-op dispatch and Python. This script
writes one decode step of a Llama-family model (the default SmolLM2-135M) as a plain module over the engine's own
weights, with the engine's bf16-mode numerics (bf16 copies for the base products, q|k|v and gate|up stacked; the
residual stream, norms, rotary and the LoRA deltas in float32; keys and values bf16), and times it three ways at
--rows rows over a --context-token cache, in one run:
- engine:   the engine's own bf16 decode step (STEPWISE_SAMPLE_DTYPE=bfloat16, Engine.run_requests, 8 requests x 4
            samples, rank-8 LoRA on every target), median step;
- eager:    the module run eagerly;
- compiled: the module through torch.compile (inductor, CPU), all of it on one thread: its C++ kernels
            (torch._inductor.config.cpp.threads = 1: with OMP_WAIT_POLICY=PASSIVE every parallel kernel wakes a sleeping
            OpenMP worker, ~100 us, where a decode step's elementwise kernels take a few us) and its products (the
            LoRA products' small MKL calls woke the second thread too).
With --dynamic it is compiled for any row count and cache length, and then run on other row counts, a longer cache
and other adapters, each first call timed: seconds mean a recompile.
Then the gap: --rows real chat prompts and answers, teacher-forced through the compiled step from an empty cache, each
position's logprob of the next real token against the trainer's (the engine's float32 forward, the same adapter),
beside the eager module's.

It supports what the default model needs (no qk-norm, sandwich norms, soft-caps or sliding windows) and one adapter
for every row; the engine's decoder supports all of it. A prototype: nothing here runs in the engine.

    .venv/bin/python bench/compiled_decode.py [--rows 32] [--context 75] [--dynamic]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchenv import BASE, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import torch  # noqa: E402
from decode_profile import QUESTIONS, best_of, step_recorder, use_sample_dtype, workload  # noqa: E402
from torch.nn import functional as F  # noqa: E402

BF16 = torch.bfloat16


class DecodeStep(torch.nn.Module):
    """One decode step of the engine's model for `rows` rows: (token ids, positions, each row's cached keys and values
    (layers, rows, kv_heads, capacity, head_dim) bf16, which cache slots each row sees) -> (float32 logits, the new
    keys and values (layers, rows, kv_heads, head_dim), which the caller writes into the cache)."""

    def __init__(self, model) -> None:
        super().__init__()
        inner, config = model.model, model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.eps = inner.layers[0].input_layernorm.variance_epsilon
        self.scale = inner.layers[0].self_attn.scaling
        self.inv_freq = inner.rotary_emb.inv_freq.detach().float()
        self.embed = inner.embed_tokens.weight.detach()

        def frozen(t):
            return torch.nn.Parameter(t.detach().contiguous(), requires_grad=False)

        def base(*modules):  # the bf16 copy of one product's weights, stacked where modules share an input
            return frozen(torch.cat([m.base.weight for m in modules]).to(BF16))

        self.layers = []
        for i, layer in enumerate(inner.layers):
            attention, mlp = layer.self_attn, layer.mlp
            parts = {"qkv": (attention.q_proj, attention.k_proj, attention.v_proj), "o": (attention.o_proj,),
                     "gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,)}
            weights = {"norm1": frozen(layer.input_layernorm.weight), "norm2": frozen(layer.post_attention_layernorm.weight)}
            for name, modules in parts.items():
                weights[name] = base(*modules)
            for name, t in weights.items():
                self.register_parameter(f"l{i}_{name}", t)
            self.layers.append(weights)
        self.norm = frozen(inner.norm.weight)
        self.head = base(model.lm_head)
        # Which modules' LoRA weights each product adds (stacked as lora.SharedCopy stacks them): `lora_inputs`
        self.parts = [parts for layer in inner.layers for parts in (
            (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), (layer.self_attn.o_proj,),
            (layer.mlp.gate_proj, layer.mlp.up_proj), (layer.mlp.down_proj,))] + [(model.lm_head,)]

    def lora_inputs(self, adapter) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The adapter's weights as the step's inputs (not constants: a new sampler's adapter runs on the same compiled
        step): each product's A stacked and B block-diagonal (float32, as lora.SharedCopy builds them), and its scale."""
        with torch.no_grad():
            flat = []
            for modules in self.parts:
                pairs = [adapter.weights[m.name] for m in modules]
                flat += [torch.cat([a for a, _ in pairs]), torch.block_diag(*(b for _, b in pairs))]
        return flat, torch.tensor(adapter.scale)

    def cache(self, rows: int, slots: int, fill=torch.zeros) -> torch.Tensor:
        """Keys or values for `rows` rows of `slots` slots, as the step reads them: (layers, rows, kv_heads, slots, head_dim)."""
        return fill(len(self.layers), rows, self.kv_heads, slots, self.head_dim, dtype=BF16)

    @staticmethod
    def product(x: torch.Tensor, weight, a, b, scale) -> torch.Tensor:
        """x (float32) W^T in bf16, back to float32, plus the adapter's delta in float32 (the engine's bf16 mode)."""
        return F.linear(x.to(BF16), weight).float() + F.linear(F.linear(x, a), b) * scale

    def forward(self, ids, positions, keys, values, seen, lora: list[torch.Tensor], scale: torch.Tensor):
        n, hd, groups = ids.shape[0], self.head_dim, self.heads // self.kv_heads
        x = F.embedding(ids, self.embed)
        angles = positions[:, None].float() * self.inv_freq[None]
        cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
        half = hd // 2

        def rotate(t):
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin
        new_keys, new_values = [], []
        for i, w in enumerate(self.layers):
            h = F.rms_norm(x, x.shape[-1:], w["norm1"], self.eps)
            qkv_a, qkv_b, o_a, o_b, gate_up_a, gate_up_b, down_a, down_b = lora[8 * i:8 * i + 8]
            q, k, v = self.product(h, w["qkv"], qkv_a, qkv_b, scale).split(
                [self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
            q, k = rotate(q.view(n, self.heads, hd)), rotate(k.view(n, self.kv_heads, hd))
            k, v = k.to(BF16), v.view(n, self.kv_heads, hd).to(BF16)
            new_keys.append(k)
            new_values.append(v)
            # Attention over the cached slots each row sees, plus the new token itself: one softmax over both, in
            # float32 (the cache is written by the caller, so the step reads it and changes nothing).
            qg = q.to(BF16).view(n, self.kv_heads, groups, hd)
            cached = torch.matmul(qg, keys[i].transpose(-1, -2)).float() * self.scale  # (n, kv_heads, groups, slots)
            cached = cached.masked_fill(~seen[:, None, None, :], float("-inf"))
            own = (qg.float() * k.float()[:, :, None]).sum(-1, keepdim=True) * self.scale  # (n, kv_heads, groups, 1)
            top = torch.maximum(cached.amax(-1, keepdim=True), own)
            p_cached, p_own = (cached - top).exp(), (own - top).exp()
            total = p_cached.sum(-1, keepdim=True) + p_own
            out = (torch.matmul(p_cached.to(BF16), values[i]).float() + p_own * v.float()[:, :, None]) / total
            x = x + self.product(out.reshape(n, -1), w["o"], o_a, o_b, scale)
            h = F.rms_norm(x, x.shape[-1:], w["norm2"], self.eps)
            gate, up = self.product(h, w["gate_up"], gate_up_a, gate_up_b, scale).chunk(2, -1)
            x = x + self.product(F.silu(gate) * up, w["down"], down_a, down_b, scale)
        x = F.rms_norm(x, x.shape[-1:], self.norm, self.eps)
        logits = self.product(x, self.head, lora[-2], lora[-1], scale)
        return logits, torch.stack(new_keys), torch.stack(new_values)


def median_ms(fn, repeat: int) -> float:
    return 1e3 * best_of(fn, repeat)  # a warm-up call, then the median of at least `repeat`


def engine_step_ms(engine, adapter_id: str, rows: int) -> float:
    """The engine's own bf16 decode step at `rows` live rows: the median over a workload's steps of exactly that many."""
    use_sample_dtype(engine, "bfloat16", quiet=True)
    engine.run_requests(workload(engine, adapter_id, rows, 40, seed=1))  # warm-up
    records, undo = step_recorder(None)
    try:
        engine.run_requests(workload(engine, adapter_id, rows, 40, seed=2))
    finally:
        undo()
    return 1e3 * statistics.median(wall for n, wall, _ in records if n == rows)


def teacher_forced(step, module: DecodeStep, engine, adapter, rows: int, length: int):
    """Each row a real chat prompt and answer of `length` tokens, fed one token a step through `step` (`module`, eager or
    compiled) from an empty cache: the logprob of each next real token from position 16 on, and the trainer's (float32
    forward) for the same."""
    from kernel_backend.engine import lora

    model, tokenizer = engine.model, engine.tokenizer
    texts = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (take {i})"},
              {"role": "assistant", "content": "Here is a short answer with a few facts, kept plain and clear for you: "
               "first, think about what matters; second, keep it simple; third, enjoy it."}] for i in range(rows)]
    ids = torch.tensor([tokenizer.apply_chat_template(t)["input_ids"][:length] for t in texts])
    assert ids.shape[1] == length, "the answers are long enough"
    keys, values = module.cache(rows, length, torch.zeros), module.cache(rows, length, torch.zeros)
    slots = torch.arange(length)
    sampled = []
    for t in range(length - 1):
        positions = torch.full((rows,), t)
        seen = (slots[None] < t).expand(rows, -1).contiguous()  # (rows, slots), as every call: shapes and strides are guards
        logits, new_k, new_v = step(ids[:, t].contiguous(), positions, keys, values, seen)
        keys[:, :, :, t], values[:, :, :, t] = new_k, new_v
        sampled.append(logits.log_softmax(-1).gather(-1, ids[:, t + 1, None])[:, 0])
    with lora.route(model, [adapter] * rows):
        trainer = model(ids).logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return torch.stack(sampled, 1)[:, 16:], trainer[:, 16:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=75, help="cached tokens a row sees (the issue's ~30-75)")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--dynamic", action="store_true", help="compile for any row count and cache length, and time "
                        "the compiled step on other shapes and adapters (does any recompile?)")
    args = parser.parse_args()

    import torch._inductor.config as inductor

    from kernel_backend.engine.core import Engine
    from kernel_backend.types import LoraConfig

    print(f"{time.strftime('%Y-%m-%d %H:%M')} {load_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    engine = Engine(BASE)

    def adapter_of(name: str, rank: int, seed: int):
        engine.create_adapter(name, LoraConfig(rank=rank, seed=seed))
        adapter = engine.adapters.get(name).adapter.detached()
        with torch.no_grad():  # B random, so that the deltas count (a fresh adapter's B is 0)
            for _, b in adapter.weights.values():
                b.normal_(0, 0.002, generator=torch.Generator().manual_seed(seed))
        return adapter
    adapter = adapter_of("compiled", 8, 0)

    def inputs_for(rows: int, context: int, lora) -> tuple:  # `step`'s inputs over a cache of random keys and values
        return (torch.randint(0, 1000, (rows,)), torch.full((rows,), context), step.cache(rows, context + 1, torch.randn),
                step.cache(rows, context + 1, torch.randn),
                (torch.arange(context + 1)[None] < context).expand(rows, -1).contiguous(), *lora)

    rows, context = args.rows, args.context
    threads = torch.get_num_threads()
    with torch.inference_mode():
        engine_ms = engine_step_ms(engine, "compiled", rows)
        step = DecodeStep(engine.model).eval()
        lora = step.lora_inputs(adapter)
        inputs = inputs_for(rows, context, lora)
        eager_ms = median_ms(lambda: step(*inputs), args.repeat)
        inductor.cpp.threads = 1
        inductor.freezing = True  # the base weights are constants: prepacked for oneDNN once
        # The whole step on one thread, always: dynamo guards on torch's thread count (a change recompiles), and on two
        # threads every small LoRA product wakes the sleeping second one (75 against 60 ms a step, measured).
        torch.set_num_threads(1)
        compiled = torch.compile(step, dynamic=args.dynamic)
        start = time.perf_counter()
        compiled(*inputs)
        compile_s = time.perf_counter() - start
        compiled_ms = median_ms(lambda: compiled(*inputs), args.repeat)
        torch.set_num_threads(threads)
        again_eager = median_ms(lambda: step(*inputs), args.repeat)
        print(f"\n{rows} rows, a {context}-token cache, rank-8 LoRA on every target (its weights the step's inputs), "
              f"medians; {load_line()}")
        print(f"  engine's bf16 decode step     {engine_ms:6.1f} ms  ({rows / engine_ms * 1e3:5.0f} tok/s)")
        print(f"  this step, eager              {eager_ms:6.1f} ms  (again after the compiled runs: {again_eager:.1f})")
        print(f"  this step, compiled, one thread {compiled_ms:6.1f} ms  ({rows / compiled_ms * 1e3:5.0f} tok/s; compiled in "
              f"{compile_s:.0f} s{', dynamic shapes' if args.dynamic else ''}): {engine_ms / compiled_ms:.2f}x the engine's "
              f"step, {eager_ms / compiled_ms:.2f}x eager")
        torch.set_num_threads(1)
        for name, fn in (("eager", step), ("compiled", compiled)):
            sampled, trainer = teacher_forced(lambda *a, fn=fn: fn(*a, *lora), step, engine, adapter, rows, 64)
            d = sampled - trainer
            print(f"  gap to the trainer (float32), {name:<8}: |sampler - trainer| mean {d.abs().mean():.2e}, max "
                  f"{d.abs().max():.2e}, mean(sampler - trainer) {d.mean():+.2e} over {d.numel()} tokens")
        if args.dynamic:  # what a decoder would meet: rows leaving, caches growing, a new sampler's adapter each RL step
            print("  the compiled step on new shapes and adapters, one thread: first call (seconds: a recompile), then median")
            other, wider = step.lora_inputs(adapter_of("other", 8, 1)), step.lora_inputs(adapter_of("wider", 32, 2))
            for label, (n, c, weights) in {"31 rows": (31, context, lora), "16 rows": (16, context, lora),
                                           "2 rows": (2, context, lora), "1 row": (1, context, lora),
                                           "a 200-token cache": (rows, 200, lora), "another rank-8 adapter": (rows, context, other),
                                           "a rank-32 adapter": (rows, context, wider)}.items():
                shaped = inputs_for(n, c, weights)
                start = time.perf_counter()
                compiled(*shaped)
                first = time.perf_counter() - start
                print(f"    {label:<24} first call {first:6.2f} s, then {median_ms(lambda: compiled(*shaped), 10):6.1f} ms",
                      flush=True)
        torch.set_num_threads(threads)
    print(load_line())


if __name__ == "__main__":
    main()
