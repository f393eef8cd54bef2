"""Small helpers shared by the engine-level tests (import them with `from helpers import ...`).

Everything here uses the real default model's tokenizer; nothing is faked.
"""

from __future__ import annotations

import functools
import time
import uuid

import numpy as np

from kernel_backend.engine import base_models
from kernel_backend.types import AdamParams, Datum, TargetIds


@functools.lru_cache(maxsize=1)
def default_tokenizer():
    """The default model's tokenizer (converts the model on first use, like the engine)."""
    from workbench.recipes.common import local_tokenizer

    return local_tokenizer(base_models.DEFAULT_MODEL)


def new_id(prefix: str = "adapter") -> str:
    """A fresh adapter / sampler id, so tests never collide on the shared session engine."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def chat_prompt(question: str, tokenizer=None) -> list[int]:
    """The chat-formatted prompt for one user turn, ending where the assistant starts."""
    tokenizer = tokenizer or default_tokenizer()
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def chat_tokens(question: str, answer: str, tokenizer=None) -> tuple[list[int], list[int]]:
    """(prompt tokens, full conversation tokens); the prompt is a prefix of the conversation."""
    tokenizer = tokenizer or default_tokenizer()
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    prompt = chat_prompt(question, tokenizer)
    full = list(tokenizer.apply_chat_template(messages)["input_ids"])
    assert full[: len(prompt)] == prompt, "the chat template's prompt is not a prefix of the conversation"
    return prompt, full


def sft_datum(question: str, answer: str, tokenizer=None) -> Datum:
    """A chat SFT example: input = conversation[:-1], target = conversation[1:], weight 1 on the
    assistant's tokens only (the positions that predict them), 0 on the prompt."""
    prompt, full = chat_tokens(question, answer, tokenizer)
    tokens, targets = full[:-1], np.asarray(full[1:], dtype=np.int64)
    weights = np.zeros(len(tokens), dtype=np.float32)
    weights[len(prompt) - 1 :] = 1.0
    return Datum(tokens=tokens, loss_fn_inputs={"target_tokens": targets, "weights": weights})


def shifted_datum(tokens: list[int], weights=None) -> Datum:
    """A plain next-token Datum over `tokens` (weights default to 1 everywhere)."""
    inputs = {"target_tokens": np.asarray(tokens[1:], dtype=np.int64)}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, dtype=np.float32)
    return Datum(tokens=list(tokens[:-1]), loss_fn_inputs=inputs)


def train(engine, adapter_id: str, data: list[Datum], steps: int, learning_rate: float = 1e-3) -> list[float]:
    """`steps` rounds of forward_backward + optim_step; returns the loss of each round."""
    out = []
    for _ in range(steps):
        result = engine.forward_backward(adapter_id, data)
        engine.optim_step(adapter_id, AdamParams(learning_rate=learning_rate))
        out.append(result.metrics["loss:sum"])
    return out


def forward_logprobs(engine, adapter_id: str, data: list[Datum]) -> list[np.ndarray]:
    """The target-token logprobs of each datum under `adapter_id` (no gradients)."""
    return [o["logprobs"] for o in engine.forward(adapter_id, data).loss_fn_outputs]


def model_logprobs(engine, adapter_id: str | None, tokens: list[int]):
    """A hand computation of the model's next-token distributions: log_softmax (float64) of the logits at
    every position of `tokens`, through transformers' own forward, under `adapter_id` (None: the base model)."""
    import torch

    from kernel_backend.engine import lora

    adapter = engine._slot(adapter_id).adapter if adapter_id is not None else None
    with torch.inference_mode(), lora.route(engine.model, [adapter]):
        return engine.model(torch.tensor([tokens])).logits[0].double().log_softmax(-1)


def target_ids(ids: np.ndarray, sparse: bool = False) -> TargetIds:
    """target_prompt_logprobs from a [len(prompt) - 1, K] array of token ids (-1: none), dense, or sparse
    CSR listing only the ids (as the SDK's TensorData.from_torch_sparse(ids, pad_value=-1) sends it)."""
    rows, cols = ids.shape
    if not sparse:
        return TargetIds((rows, cols), np.repeat(np.arange(rows), cols), ids.reshape(-1).astype(np.int64))
    listed_rows, listed_cols = np.nonzero(ids >= 0)
    crow = np.concatenate([[0], np.cumsum(np.bincount(listed_rows, minlength=rows))])
    return TargetIds((rows, cols), listed_rows, ids[listed_rows, listed_cols].astype(np.int64), crow.tolist(),
                     listed_cols.tolist())


def one_lora_layer(in_features: int, out_features: int):
    """A model of one frozen linear layer named q_proj, wrapped for LoRA (lora.attach), on the CPU."""
    import torch

    from kernel_backend.engine import lora

    model = torch.nn.Sequential()
    model.add_module("q_proj", torch.nn.Linear(in_features, out_features, bias=False))
    model.requires_grad_(False)
    model.device = torch.device("cpu")
    lora.attach(model)
    return model


def wait_until(condition, timeout: float = 30.0, what: str = "", every: float = 0.01) -> None:
    """Watch `condition()` (every `every` seconds) until it is true; an AssertionError naming `what` once `timeout`
    seconds pass.

    For a test waiting on another thread or process: it goes on as soon as the condition holds, never after a
    guessed sleep, and the timeout only bounds a failure (issue 57)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what or 'the condition'}"
        time.sleep(every)
