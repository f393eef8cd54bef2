"""A quick check of the engine on one GPU, from a bare image: no weights, nothing downloaded.

Builds a ~1B Llama-style model (Llama-3.2-1B's shape, 32k vocabulary) with random weights and a
word-level tokenizer into a temporary folder, loads it with the engine in bf16, and prints:

1. the GPU's measured bf16 matmul peak (a large square matmul, best of several);
2. the engine's bf16 LoRA training throughput (forward_backward + optim_step, rank 32 on every
   target), in tokens/s and as MFU against that measured peak. Model FLOPs per token: 2N forward
   + 2N backward (the frozen base needs gradients for its activations only, not its weights; the
   LoRA weights' own gradients are negligible) + causal attention, 2 x layers x seq x hidden
   forward and twice that backward;
3. the built-in sampler's tokens/s at batch 64 (one prompt, 64 samples, fixed length) against
   transformers' `generate` on the same weights, and their ratio.

    bash bench/gpu_check.sh            # on a GPU machine, about 2-3 minutes
    bash bench/gpu_check.sh --smoke    # a tiny model on CPU: checks the script itself, in seconds

Only torch, transformers, safetensors and numpy are needed (peft is not): run from the repository.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchenv  # noqa: E402, F401 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402

# Llama-3.2-1B's shape with a 32k vocabulary (about 1.0B parameters, embeddings tied).
FULL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


def build_model(directory: Path, shape: dict, dtype: torch.dtype, device: str) -> int:
    """A random-weight Llama model and a word-level tokenizer saved as a local HF folder; returns
    the parameter count."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, shape["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="</s>").save_pretrained(directory)
    config = LlamaConfig(**shape, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds, not a minute of CPU
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def matmul_peak(device: str, dtype: torch.dtype, n: int) -> float:
    """Measured FLOP/s of an n x n x n matmul in `dtype`, best of 10."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    return max(2 * n**3 / timed(lambda: a @ b, device) for _ in range(10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU: checks that the script runs")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps (after one warm-up)")
    args = parser.parse_args()

    from kernel_backend.config import Settings
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import AdamParams, Datum, LoraConfig, SamplingParams

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.smoke:
        sys.exit("no GPU here: run with --smoke to check the script on CPU")
    shape = SMOKE if args.smoke else FULL
    batch, seq = (2, 64) if args.smoke else (8, 2048)
    samples, new_tokens, prompt_length = (64, 16, 16) if args.smoke else (64, 128, 128)
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    print(f"device: {name} | torch {torch.__version__} | dtype bf16")

    with tempfile.TemporaryDirectory(prefix="stepwise-gpu-check-") as tmp:
        start = time.perf_counter()
        params = build_model(Path(tmp), shape, dtype, device)
        settings = Settings(home=Path(tmp) / "home", device=device, dtype="bfloat16", base_models=[tmp],
                            micro_batch_tokens=batch * seq, max_batch_tokens=batch * seq)
        engine = Engine(tmp, settings)
        print(f"model: random Llama, {params / 1e6:,.1f}M parameters ({shape['num_hidden_layers']} layers, hidden "
              f"{shape['hidden_size']}), built and loaded in {time.perf_counter() - start:.0f} s")

        peak = matmul_peak(device, dtype, 1024 if args.smoke else 8192)
        print(f"1. measured bf16 matmul peak: {peak / 1e12:.1f} TFLOP/s")

        # 2. training: random tokens (cost the same as text), LoRA rank 32 on every target
        engine.create_adapter("train", LoraConfig(rank=32, seed=0))
        rng = np.random.default_rng(0)
        data = []
        for _ in range(batch):
            tokens = rng.integers(3, shape["vocab_size"], size=seq + 1)
            data.append(Datum(tokens=tokens[:-1].tolist(), loss_fn_inputs={"target_tokens": tokens[1:].astype(np.int64)}))

        def train_step():
            engine.forward_backward("train", data, "cross_entropy")
            engine.optim_step("train", AdamParams(learning_rate=1e-4))

        timed(train_step, device)  # warm-up
        seconds = statistics.median(timed(train_step, device) for _ in range(args.steps))
        tokens = batch * seq
        layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
        flops_per_token = 4 * params + 3 * 2 * layers * seq * hidden
        mfu = tokens * flops_per_token / seconds / peak
        print(f"2. LoRA training (rank 32, batch {batch} x {seq}): {tokens / seconds:,.0f} tokens/s, "
              f"{seconds:.3f} s/step, MFU {100 * mfu:.1f}% of the measured peak")

        # 3. sampling at batch 64: one prompt, every row the same fixed length
        prompt = rng.integers(3, shape["vocab_size"], size=prompt_length).tolist()

        def ours():
            engine.sample(None, prompt, samples, SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[], seed=0))

        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
        ids = torch.tensor([prompt], device=device)

        @torch.inference_mode()
        def generate():
            reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, num_return_sequences=samples, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=2)

        runs = {"stepwise": ours, "generate": generate}
        for run in runs.values():
            timed(run, device)  # warm-up
        rates = {}
        for name_, run in runs.items():
            rates[name_] = samples * new_tokens / statistics.median(timed(run, device) for _ in range(3))
        print(f"3. sampling, batch {samples} x {new_tokens} new tokens (prompt {prompt_length}): stepwise "
              f"{rates['stepwise']:,.0f} tokens/s, transformers generate {rates['generate']:,.0f} tokens/s, "
              f"ratio {rates['stepwise'] / rates['generate']:.2f}")


if __name__ == "__main__":
    main()
