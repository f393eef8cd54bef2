"""Generation on CPU (or one device) with transformers: a plain decode loop over a KV cache.

We write the loop ourselves rather than call `generate` because we need, exactly:
- the model's own logprob of every sampled token (before temperature / top-k / top-p), so that
  `sample` and `compute_logprobs` agree on the same tokens and weights;
- Tinker's stop semantics (end-of-sequence by default, strings or token ids, `[]` = never);
- one prefill shared by all `num_samples` rows, and a seedable generator.
Rows are routed through the adapter by `lora.route`, like training.
"""

from __future__ import annotations

import torch

from kernel_backend.types import SampledSequence, SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering; masked entries become -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (always keep the first).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    num_samples: int,
    params: SamplingParams,
    stop_token_ids: set[int],
    stop_strings: list[str],
    decode,
    prompt_logits_out: list | None = None,
    topk_sample_logprobs: int = 0,
    on_token=None,
) -> list[SampledSequence]:
    """Sample `num_samples` continuations of `prompt`. The caller has set up LoRA routing.

    `decode(tokens) -> str` is used only for stop strings. When `prompt_logits_out` is a list,
    the prefill's logits for every prompt position are appended to it (for prompt logprobs).
    `topk_sample_logprobs` > 0 records the k most likely tokens at each sampled position;
    `on_token(row, token, logprob)` is called as each token is chosen (for streaming).
    """
    device = model.device
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)

    # logits_to_keep=0 keeps every position (needed for prompt logprobs); 1 only the last.
    keep = 0 if prompt_logits_out is not None else 1
    out = model(torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=keep)
    if prompt_logits_out is not None:
        prompt_logits_out.append(out.logits[0].float())
    cache = out.cache
    cache.batch_repeat_interleave(num_samples)
    next_logits = out.logits[:, -1, :].float().expand(num_samples, -1)

    tokens: list[list[int]] = [[] for _ in range(num_samples)]
    logprobs: list[list[float]] = [[] for _ in range(num_samples)]
    top: list[list[list[tuple[int, float]]]] = [[] for _ in range(num_samples)]
    stopped = [False] * num_samples
    for _ in range(params.max_tokens):
        model_logprobs = next_logits.log_softmax(-1)
        if params.temperature == 0:
            chosen = next_logits.argmax(-1)
        else:
            probs = filter_logits(next_logits, params).softmax(-1)
            chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        chosen_logprobs = model_logprobs.gather(-1, chosen[:, None]).squeeze(-1)
        if topk_sample_logprobs:
            best = torch.topk(model_logprobs, topk_sample_logprobs, dim=-1)
            best_pairs = [list(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
        for row, (token, logprob) in enumerate(zip(chosen.tolist(), chosen_logprobs.tolist())):
            if stopped[row]:
                continue
            tokens[row].append(token)
            logprobs[row].append(logprob)
            if topk_sample_logprobs:
                top[row].append(best_pairs[row])
            if on_token is not None:
                on_token(row, token, logprob)
            if token in stop_token_ids or (stop_strings and _ends_with_stop(decode(tokens[row]), stop_strings)):
                stopped[row] = True
        if all(stopped):
            break
        out = model(chosen[:, None], cache=cache, use_cache=True)
        cache = out.cache
        next_logits = out.logits[:, -1, :].float()
    return [
        SampledSequence(tokens=t, logprobs=lp, stop_reason="stop" if s else "length", top_logprobs=k or None)
        for t, lp, s, k in zip(tokens, logprobs, stopped, top)
    ]


def _ends_with_stop(text: str, stop_strings: list[str]) -> bool:
    return any(s in text for s in stop_strings)
