"""Sampling: the continuous-batching decoder against the loop it replaced, against vLLM, and against `generate`.

Five parts, each printing a ratio measured in this one run (higher is better):

- server:   eight concurrent sample requests from four sessions (each its own LoRA sampler,
            num_samples 4, max_tokens 32, temperature 1, a seed each) through the official tinker
            SDK against real servers: aggregate sampled tokens/s with the batched decoder (the
            default) over the same requests on a server started with STEPWISE_SAMPLER=<--sampler>.
            Rounds alternate between the servers.
            --sampler serial (the default): the loop every request went through before, one request
            after another. Both give the same tokens for the same seeds (the script checks), so they
            do the same work.                                   Target: >= 5x.
            --sampler vllm: the vLLM sampler (needs its venv: python -m kernel_backend.vllm.venv
            build). Its random streams are not ours, so every sample runs exactly 32 tokens
            (stop=[]) for the same work; the requests run once through the LoRA samplers and once
            through base-model samplers; printed also: each server's start-up (the vLLM worker's
            apart), and the sampler-vs-trainer logprob gap (|vLLM's logprob - the batched server's
            compute_logprobs| on vLLM's tokens, same weights).
            --sample-bf16: also a batched server with STEPWISE_SAMPLE_DTYPE=bfloat16 (a bf16 copy of the base
            weights for sampling, float32 for training: engine/lora.py), its tokens/s against the float32
            batched server's, and its logprobs against that server's compute_logprobs (float32) on its tokens.
- generate: one adapter (rank 32, every target), one prompt, 8 samples of 64 tokens at
            temperature 1, in this process: `Engine.sample` over transformers' `generate` on the
            PEFT model (peft.get_peft_model, the same LoRA shape).      Target: >= 1.0x.
- small:    the server part's workload in this process, through each decoder, with small products
            on one thread (kernel_backend/engine/small_products.py, the default) and on every thread.
- family:   the small part's workload (batched against serial, threads as the server has them) on a
            tiny random Qwen3 built from its config (hidden 256, 4 layers, the default model's
            tokenizer): the families beyond Llama take the batched decoder too (kernel_backend/engine/families.py).
- prefix:   one distillation step's teacher scoring (16 compute_logprobs sharing their prompts) in
            this process, with the prefix cache (kernel_backend/engine/prefix_cache.py) on and off.
- recipes:  the rl and distillation recipes with their defaults, each against a serial-sampler
            server and a batched one: wall time, and the recipe's final metric. Long (tens of
            minutes); not in the default set.                            Target: time halved.

    .venv/bin/python bench/sample.py [--parts server,generate] [--rounds 2] [--threads N] [--server-threads N] [--bf16]
    .venv/bin/python bench/sample.py --parts server --sampler vllm
    .venv/bin/python bench/sample.py --parts server --sample-bf16
    .venv/bin/python bench/sample.py --parts small --rounds 3
    .venv/bin/python bench/sample.py --parts prefix --rounds 3
    .venv/bin/python bench/sample.py --parts family --rounds 3
    .venv/bin/python bench/sample.py --parts recipes
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchenv import BASE, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402


QUESTIONS = [
    "What is your favorite color?", "How are you today?", "What should I eat for dinner?", "Tell me about dogs.",
    "What is the weather like in spring?", "Can you recommend a book?", "What is a good hobby?",
    "How do I stay healthy?",
]


SERVER_ENV: dict[str, str] = {}  # extra environment for the servers (--server-threads)


def start(sampler: str, dtype: str = "float32", sample_dtype: str = "float32"):
    """A backend process with its own home (the default model is shared), sampling with `sampler` (the built-in
    one's base products in `sample_dtype`). A vLLM server answers once its worker is up (minutes on a busy CPU)."""
    from servers import start_server

    home = Path(tempfile.mkdtemp(prefix=f"stepwise-bench-{sampler}-"))
    (home / "models").symlink_to(Path.home() / ".cache" / "stepwise" / "models")
    env = {"STEPWISE_SAMPLER": sampler, "STEPWISE_DTYPE": dtype, "STEPWISE_SAMPLE_DTYPE": sample_dtype, **SERVER_ENV}
    return start_server(home, env=env, timeout=900 if sampler == "vllm" else 180)


def vllm_startup_s(server) -> float:
    """The vLLM worker's own start-up, from the server's admin stats."""
    import httpx

    stats = httpx.get(f"{server.base_url}/api/v1/admin/stats", headers={"X-API-Key": server.api_key}, timeout=60)
    return stats.json()["vllm"][BASE]["startup_s"]


def cpu_seconds(server) -> float:
    """User + system CPU seconds the server process and its descendants (a vLLM worker and its engine
    process) have used so far (Linux /proc)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # from the state field on
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    total, stack = 0, [server.process.pid]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


# ---- server: concurrent requests through the SDK ------------------------------------------------


class Sessions:
    """Four sessions on one server, each with a sampler: of a fresh LoRA adapter (rank 32, its own
    seed, so every server gets the same weights) or of the base model."""

    def __init__(self, server, tokenizer, lora: bool = True) -> None:
        import tinker

        self.samplers = []
        for seed in range(4):
            client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
            if lora:
                training = client.create_lora_training_client(base_model=BASE, rank=32, seed=seed).result()
                self.samplers.append(training.save_weights_and_get_sampling_client().result())
            else:
                self.samplers.append(client.create_sampling_client(base_model=BASE).result())
        self.prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
            for q in QUESTIONS
        ]

    def round(self, max_tokens: int = 32, num_samples: int = 4, stop=None) -> tuple[float, list]:
        """All eight requests at once (two per session); (seconds to the last result, their SampleResponses)."""
        from tinker import types

        start_time = time.perf_counter()
        futures = [
            self.samplers[i % 4].sample(types.ModelInput.from_ints(prompt), num_samples,
                                        types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, stop=stop))
            for i, prompt in enumerate(self.prompts)
        ]
        results = [f.result() for f in futures]
        return time.perf_counter() - start_time, results

    def logprob_gap(self, results) -> list[float]:
        """|logprob - this server's compute_logprobs| of every token of `results` (another server's
        samples of the same prompts, from samplers with the same weights)."""
        from tinker import types

        gaps = []
        for i, (prompt, result) in enumerate(zip(self.prompts, results)):
            for seq in result.sequences:
                scored = self.samplers[i % 4].compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
                gaps += [abs(a - b) for a, b in zip(seq.logprobs, scored[len(prompt):])]
        return gaps


def bench_server(rounds: int, bf16: bool, baseline: str, sample_bf16: bool = False) -> None:
    """The batched server against one sampling with `baseline` (serial or vllm). `bf16` adds a server,
    batched with bf16 weights, for the record: its tokens differ (other numerics) and its logprobs are
    not the fp32 ones (docs/performance.md, precision). `sample_bf16` adds one whose sampler alone runs on a
    bf16 copy of the weights (STEPWISE_SAMPLE_DTYPE)."""
    from workbench.recipes.common import local_tokenizer

    tokenizer = local_tokenizer(BASE)
    # name: (STEPWISE_SAMPLER, STEPWISE_DTYPE, STEPWISE_SAMPLE_DTYPE)
    kinds = {baseline: (baseline, "float32", "float32"), "batched": ("batched", "float32", "float32")}
    if bf16:
        kinds["batched-bf16"] = ("batched", "bfloat16", "float32")
    if sample_bf16:
        kinds["sample-bf16"] = ("batched", "float32", "bfloat16")
    servers, startup = {}, {}
    try:
        for name, (sampler, dtype, sample_dtype) in kinds.items():
            start_time = time.perf_counter()
            servers[name] = start(sampler, dtype, sample_dtype)
            startup[name] = time.perf_counter() - start_time
        print("\n[server] start-up (until the server answers): " + ", ".join(f"{n} {s:.1f} s" for n, s in startup.items())
              + (f"; of which the vLLM worker {vllm_startup_s(servers['vllm']):.1f} s" if baseline == "vllm" else ""))
        # vLLM samples its own random streams: equal work needs a fixed length, so no sample stops early.
        stop = [] if baseline == "vllm" else None
        workloads = {"LoRA rank 32": True, "base model": False} if baseline == "vllm" else {"LoRA rank 32": True}
        for label, lora in workloads.items():
            _server_workload(servers, tokenizer, label, lora, rounds, stop, baseline)
    finally:
        for server in servers.values():
            server.stop()


def _server_workload(servers, tokenizer, label: str, lora: bool, rounds: int, stop, baseline: str) -> None:
    sessions = {name: Sessions(server, tokenizer, lora) for name, server in servers.items()}
    for s in sessions.values():
        s.round(max_tokens=2)  # warm-up: first use of each sampler
    seconds: dict[str, list[float]] = {name: [] for name in servers}
    cpu: dict[str, float] = {name: 0.0 for name in servers}
    outputs: dict[str, list] = {}
    load_before = load_line()
    for i in tqdm(range(rounds), desc=f"{label}: rounds (alternating)"):
        for name in list(servers) if i % 2 == 0 else reversed(list(servers)):
            cpu_before = cpu_seconds(servers[name])
            elapsed, outputs[name] = sessions[name].round(stop=stop)
            seconds[name].append(elapsed)
            cpu[name] += cpu_seconds(servers[name]) - cpu_before
    # The same seeds every round: each server samples the same tokens in every round.
    tokens_of = {name: [[list(s.tokens) for s in r.sequences] for r in out] for name, out in outputs.items()}
    tokens = {name: sum(len(t) for request in out for t in request) for name, out in tokens_of.items()}
    rate = {name: tokens[name] * len(s) / sum(s) for name, s in seconds.items()}
    cpu_per_token = {name: cpu[name] / (tokens[name] * rounds) for name in servers}
    print(f"\n[server, {label}] 8 requests x 4 samples x {'exactly' if stop == [] else 'max'} 32 tokens, 4 sessions, "
          f"{tokens['batched']} sampled tokens a round")
    for name in servers:
        print(f"  {name:<12} {rate[name]:7.1f} sampled tokens/s, {cpu[name] / rounds:5.1f} server CPU s a round   "
              "rounds: " + " ".join(f"{s:.1f}s" for s in seconds[name]))
    if baseline == "serial":
        print(f"  same tokens from both decoders: {'yes' if tokens_of['serial'] == tokens_of['batched'] else 'NO'}")
    else:
        gaps = sessions["batched"].logprob_gap(outputs[baseline])
        print(f"  {baseline} logprobs vs the batched server's compute_logprobs on its tokens: "
              f"mean {statistics.mean(gaps):.1e}, max {max(gaps):.1e}")
    print(f"  ratio batched / {baseline}: {rate['batched'] / rate[baseline]:.2f} (wall), "
          f"{cpu_per_token[baseline] / cpu_per_token['batched']:.2f} (server CPU time per token)"
          f"{'   target >= 5' if baseline == 'serial' else ''}   ({load_before} before, {load_line()} after)")
    if "batched-bf16" in servers:
        print(f"  ratio batched-bf16 / {baseline} (fp32): {rate['batched-bf16'] / rate[baseline]:.2f} (wall), "
              f"{cpu_per_token[baseline] / cpu_per_token['batched-bf16']:.2f} (server CPU time per token)")
    if "sample-bf16" in servers:
        gaps = sessions["batched"].logprob_gap(outputs["sample-bf16"])
        print(f"  ratio sample-bf16 / batched (float32 sampling): {rate['sample-bf16'] / rate['batched']:.2f} (wall), "
              f"{cpu_per_token['batched'] / cpu_per_token['sample-bf16']:.2f} (server CPU time per token); its logprobs "
              f"vs the float32 server's compute_logprobs on its tokens: mean {statistics.mean(gaps):.1e}, max {max(gaps):.1e}")


# ---- generate: in-process against transformers + peft ------------------------------------------------


def interleaved(sides, run, rounds: int) -> tuple[dict, dict, str]:
    """Time run(side) for every side, `rounds` times after one warm-up each, the order reversed every other
    round so that a busy machine's drift hits each side alike. Returns each side's seconds per round, its
    last result, and the machine's load when the timed rounds began."""
    results = {side: run(side) for side in sides}  # warm-up
    seconds = {side: [] for side in sides}
    load_before = load_line()
    for i in tqdm(range(rounds), desc="rounds (interleaved)"):
        for side in sides if i % 2 == 0 else list(reversed(sides)):
            start_time = time.perf_counter()
            results[side] = run(side)
            seconds[side].append(time.perf_counter() - start_time)
    return seconds, results, load_before


def bench_generate(rounds: int, samples: int = 8, new_tokens: int = 64) -> None:
    import warnings

    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from kernel_backend.engine.core import Engine
    from kernel_backend.types import LoraConfig, SamplingParams

    engine = Engine(BASE)
    engine.create_adapter("bench", LoraConfig(rank=32, seed=0))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}],
                                                  add_generation_prompt=True)["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(engine.base.path, dtype=torch.float32).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        peft_model = get_peft_model(base, PeftLoraConfig(r=32, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    peft_model.eval()
    ids = torch.tensor([prompt])

    def ours() -> int:
        params = SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[], seed=0)
        return sum(len(s.tokens) for s in engine.sample("bench", prompt, samples, params).sequences)

    @torch.inference_mode()
    def theirs() -> int:
        out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, num_return_sequences=samples, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=engine.tokenizer.eos_token_id)
        return (out.shape[1] - ids.shape[1]) * samples

    runners = {"stepwise": ours, "generate": theirs}
    tokens = samples * new_tokens

    def run(name: str) -> int:
        made = runners[name]()
        assert made == tokens, (name, made)  # both sample every token asked for: the same work
        return made

    seconds, _, load_before = interleaved(list(runners), run, rounds)
    rate = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    print(f"\n[generate] one adapter (rank 32), {samples} samples x {new_tokens} tokens, temperature 1, "
          f"{torch.get_num_threads()} threads")
    for name in runners:
        print(f"  {name:<9} {rate[name]:7.1f} tokens/s (median round)   rounds: " + " ".join(f"{s:.2f}s" for s in seconds[name]))
    print(f"  ratio stepwise / generate: {rate['stepwise'] / rate['generate']:.2f}   target >= 1.0   "
          f"({load_before} before, {load_line()} after)")


# ---- small: small products on one thread (kernel_backend/engine/small_products.py) vs on every thread --------------------


def bench_small_products(rounds: int) -> None:
    """The server part's workload (8 requests x 4 samples x 32 tokens, four rank-32 adapters) in this
    process, through each decoder, with small_products.small on (the default) and off (SMALL_WORK = 0: every
    product on every thread, as before it), rounds interleaved."""
    import torch

    from kernel_backend.engine import small_products
    from kernel_backend.engine.core import Engine

    engine = workload_engine(Engine(BASE))
    default_work = small_products.SMALL_WORK

    def run(side: tuple[str, bool]) -> int:
        decoder, small_on = side
        small_products.SMALL_WORK = default_work if small_on else 0
        return decode_workload(engine, decoder)

    sides = [(decoder, on) for decoder in ("batched", "serial") for on in (True, False)]
    seconds, tokens, load_before = interleaved(sides, run, rounds)
    small_products.SMALL_WORK = default_work
    print(f"\n[small] 8 requests x 4 samples x max 32 tokens, 4 adapters, in process, {torch.get_num_threads()} threads, "
          "OMP_WAIT_POLICY=" + os.environ.get("OMP_WAIT_POLICY", ""))
    rate = {side: tokens[side] / statistics.median(s) for side, s in seconds.items()}
    for decoder, on in sides:
        print(f"  {decoder:<8} small products {'on one thread ' if on else 'on every thread'} "
              f"{rate[(decoder, on)]:7.1f} tokens/s   rounds: " + " ".join(f"{s:.2f}s" for s in seconds[(decoder, on)]))
    for decoder in ("batched", "serial"):
        print(f"  ratio {decoder}, one thread / every thread: {rate[(decoder, True)] / rate[(decoder, False)]:.2f}")
    print(f"  ({load_before} before, {load_line()} after)")


def workload_engine(engine):
    """An engine with the four rank-32 adapters the small and family parts sample with."""
    from kernel_backend.types import LoraConfig

    for seed in range(4):
        engine.create_adapter(f"bench{seed}", LoraConfig(rank=32, seed=seed))
    return engine


def decode_workload(engine, decoder: str) -> int:
    """The server part's requests (8 prompts x 4 samples x max 32 tokens, a seed each, over the four adapters)
    through `decoder` ("batched" or "serial") in this process; returns the tokens sampled."""
    from kernel_backend.types import SamplingParams

    engine.settings.sampler = decoder
    engine.reset_decoder()
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in QUESTIONS]
    requests = [engine.sample_request(f"bench{i % 4}", prompt, 4, SamplingParams(max_tokens=32, temperature=1.0, seed=i))
                for i, prompt in enumerate(prompts)]
    return sum(len(s.tokens) for r in engine.run_requests(requests) for s in r.sequences)


# ---- family: a model family beyond Llama on the batched decoder -------------------------------------------


def bench_family(rounds: int) -> None:
    """A tiny random Qwen3 (q/k norms: engine/families.py) through the batched decoder and the serial loop."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kernel_backend.config import Settings
    from kernel_backend.engine.core import Engine
    from helpers import default_tokenizer

    tokenizer = default_tokenizer()
    folder = Path(tempfile.mkdtemp(prefix="tiny-qwen3-"))
    config = AutoConfig.for_model("qwen3", vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    settings = Settings()
    settings.base_models = [f"tiny-qwen3={folder}"]
    engine = workload_engine(Engine("tiny-qwen3", settings))
    sides = ["batched", "serial"]
    seconds, tokens, load_before = interleaved(sides, lambda side: decode_workload(engine, side), rounds)
    rate = {side: tokens[side] / statistics.median(s) for side, s in seconds.items()}
    print(f"\n[family] tiny random Qwen3 (hidden 256, 4 layers), 8 requests x 4 samples x max 32 tokens, 4 adapters, "
          f"{torch.get_num_threads()} threads")
    for side in sides:
        print(f"  {side:<8} {rate[side]:7.1f} tokens/s   rounds: " + " ".join(f"{s:.2f}s" for s in seconds[side]))
    print(f"  ratio batched / serial: {rate['batched'] / rate['serial']:.2f}   ({load_before} before, {load_line()} after)")


# ---- prefix: the prefix cache on one distillation step's teacher scoring ----------------------------------


def bench_prefix(rounds: int) -> None:
    """The distillation recipe's teacher scoring of one step, in this process: 16 compute_logprobs
    (4 questions x 4 answers of 24 tokens, each behind the pirate system prompt, base model),
    submitted together, with the prefix cache on (the default) and off, rounds interleaved."""
    from kernel_backend.engine import prefix_cache
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import SampleOptions, SamplingParams
    from workbench.recipes import distillation

    engine = Engine(BASE)
    tokenizer = engine.tokenizer
    generator = np.random.default_rng(0)
    sequences = []
    for question in QUESTIONS[:4]:
        messages = [{"role": "system", "content": distillation.Config.teacher_system}, {"role": "user", "content": question}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        sequences += [prompt + generator.integers(0, 49152, 24).tolist() for _ in range(4)]
    default_min = prefix_cache.MIN_SHARED_TOKENS

    def run(cache_on: bool) -> list:
        prefix_cache.MIN_SHARED_TOKENS = default_min if cache_on else 10**9
        engine.reset_decoder()
        params, options = SamplingParams(max_tokens=1, temperature=0.0), SampleOptions(prompt_logprobs=True)
        requests = [engine.sample_request(None, seq, 1, params, options) for seq in sequences]
        results = [r.prompt_logprobs for r in engine.run_requests(requests)]
        reused[cache_on] = engine.decoder.prefixes.reused_tokens
        return results

    reused: dict[bool, int] = {}

    seconds, outputs, load_before = interleaved([True, False], run, rounds)
    prefix_cache.MIN_SHARED_TOKENS = default_min
    gap = max(abs(a - b) for on, off in zip(outputs[True], outputs[False]) for a, b in zip(on[1:], off[1:]))
    positions = sum(len(s) for s in sequences)
    print(f"\n[prefix] 16 compute_logprobs of {positions} positions in all (a distillation step's teacher), base model")
    for side, label in ((True, "cache on "), (False, "cache off")):
        print(f"  {label} {statistics.median(seconds[side]):6.2f} s (median)   rounds: "
              + " ".join(f"{s:.2f}s" for s in seconds[side]))
    print(f"  positions reused from the cache in a round: {reused[True]} of {positions}; largest logprob difference {gap:.1e}")
    print(f"  ratio off / on: {statistics.median(seconds[False]) / statistics.median(seconds[True]):.2f}   "
          f"({load_before} before, {load_line()} after)")


# ---- recipes: rl and distillation, serial vs batched ---------------------------------------------------


def compute_seconds(server, session_id: str) -> dict[str, float]:
    """The session's compute seconds by request type, from the usage ledger (a batched request's
    share of each decode step it was in)."""
    import httpx

    response = httpx.get(f"{server.base_url}/api/v1/usage", params={"session_id": session_id, "limit": 10_000},
                         headers={"X-API-Key": server.api_key}, timeout=60)
    response.raise_for_status()
    seconds: dict[str, float] = {}
    for row in response.json()["series"]:
        seconds[row["request_type"]] = seconds.get(row["request_type"], 0.0) + row["duration_s"]
    return seconds


def bench_recipes() -> None:
    from workbench.recipes import distillation, rl

    recipes = {
        "rl": (rl, lambda s: f"eval_reward {s.extra['eval_reward_before']:.2f} -> {s.extra['eval_reward_after']:.2f}"),
        "distillation": (distillation, lambda s: f"kl_teacher {s.initial:.3f} -> {s.final:.3f}"),
    }
    results = {}
    for sampler in ("serial", "batched"):
        server = start(sampler)
        try:
            for name, (module, headline) in recipes.items():
                load_before = load_line()
                start_time = time.perf_counter()
                config = module.Config(base_url=server.base_url, api_key=server.api_key, verbose=False,
                                       metrics_path=str(server.home / f"{name}.jsonl"))
                summary = module.run(config)
                elapsed = time.perf_counter() - start_time
                results[(name, sampler)] = (elapsed, headline(summary), load_before,
                                            compute_seconds(server, summary.session_id))
        finally:
            server.stop()
    print("\n[recipes] defaults, one server per sampler; compute seconds by request type from the ledger")
    for name in recipes:
        for sampler in ("serial", "batched"):
            elapsed, headline, load, seconds = results[(name, sampler)]
            by_type = ", ".join(f"{kind} {s:.0f}s" for kind, s in sorted(seconds.items(), key=lambda kv: -kv[1]))
            print(f"  {name:<13} {sampler:<8} {elapsed / 60:5.1f} min  {headline}  ({load})\n  {'':<13} {by_type}")
        ratio = results[(name, "serial")][0] / results[(name, "batched")][0]
        sampling = results[(name, "serial")][3].get("Sample", 0) / max(1e-9, results[(name, "batched")][3].get("Sample", 0))
        print(f"  {'':<13} wall time serial / batched: {ratio:.2f} (target >= 2); sampling compute: {sampling:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="server,generate", help="comma-separated: server, generate, small, family, prefix, recipes")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per side (after a warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in this process (0: torch's default)")
    parser.add_argument("--server-threads", type=int, default=0, help="OMP_NUM_THREADS for the servers (0: default)")
    parser.add_argument("--bf16", action="store_true", help="server part: also a batched server with bf16 weights")
    parser.add_argument("--sample-bf16", action="store_true",
                        help="server part: also a batched server sampling on a bf16 copy (STEPWISE_SAMPLE_DTYPE=bfloat16)")
    parser.add_argument("--sampler", choices=("serial", "vllm"), default="serial",
                        help="server part: what the batched decoder is compared with (STEPWISE_SAMPLER of the other server)")
    args = parser.parse_args()
    if args.server_threads:
        SERVER_ENV["OMP_NUM_THREADS"] = str(args.server_threads)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    parts = {"server": lambda: bench_server(args.rounds, args.bf16, args.sampler, args.sample_bf16),
             "generate": lambda: bench_generate(args.rounds),
             "small": lambda: bench_small_products(args.rounds),
             "family": lambda: bench_family(args.rounds),
             "prefix": lambda: bench_prefix(args.rounds),
             "recipes": bench_recipes}
    for part in args.parts.split(","):
        parts[part.strip()]()


if __name__ == "__main__":
    main()
