"""The few pieces the recipes share: connecting, chat data, rollouts as datums, a learning-rate
schedule, a JSONL metrics log, progress bars, the end-of-run summary read from the usage API, and a
command line (the estimate of a run's tokens and cost before it runs: workbench/recipes/estimates.py).

Everything here is plain tinker SDK usage; a recipe is a config dataclass plus a loop built from
these pieces (tinker-cookbook style), small enough to copy into a notebook and change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import types as pytypes
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import tinker
from tinker import types

from kernel_backend import tool_calls
from kernel_backend.metering import KINDS
from workbench.client.connection import session_id_of

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DATA_DIR = Path(__file__).resolve().parent / "data"


# ---------------------------------------------------------------------------------------------
# Configuration shared by every recipe


@dataclass
class BaseConfig:
    """Fields every recipe has. `base_url`/`api_key` are used when run() gets no service client."""

    base_url: str | None = None
    api_key: str | None = None
    base_model: str = DEFAULT_MODEL
    rank: int = 8                    # 0: full fine-tuning, every weight (give it a learning rate ~10x lower)
    seed: int = 0
    learning_rate: float = 1e-3
    metrics_path: str | None = None  # JSONL, one line per step; None: $STEPWISE_HOME/runs/<recipe>-<time>.jsonl
    progress: bool = True            # a tqdm bar (tqdm.auto: a widget in notebooks)
    verbose: bool = True             # print the summary at the end
    run_name: str | None = None      # the run's name on dashboards and in the sidebar (its user_metadata "name")
    load_checkpoint_path: str | None = None  # start from these weights (a tinker://.../weights/... path), e.g. an SFT warm-up's


def training_client(service_client: tinker.ServiceClient, config: BaseConfig):
    """The recipe's training run (LoRA; rank 0: full fine-tuning) on config's base model, rank and seed, named `config.run_name` if set;
    from `config.load_checkpoint_path`'s weights if set (its rank, a fresh optimizer)."""
    metadata = {"name": config.run_name} if config.run_name else None
    if config.load_checkpoint_path:
        return service_client.create_training_client_from_state(config.load_checkpoint_path,
                                                                user_metadata=metadata).result()
    return service_client.create_lora_training_client(
        base_model=config.base_model, rank=config.rank, seed=config.seed, user_metadata=metadata).result()


def service_client_for(config: BaseConfig, service_client: tinker.ServiceClient | None) -> tinker.ServiceClient:
    from workbench.client.connect import quiet_long_polls

    quiet_long_polls()  # the SDK's routine "Retrying request ... try_again" lines, under a progress bar
    if service_client is not None:
        return service_client
    if not config.base_url or not config.api_key:
        raise ValueError(
            "run(config) without a service_client needs config.base_url and config.api_key "
            "(or pass service_client=workbench.connect())"
        )
    return tinker.ServiceClient(base_url=config.base_url, api_key=config.api_key)


def endpoint_of(config: BaseConfig, service_client: tinker.ServiceClient) -> tuple[str, str]:
    """(base_url, api_key) for the usage API: the config's, else the ones the client was built with."""
    holder = getattr(service_client, "holder", None)
    base_url = config.base_url or getattr(holder, "_base_url", None)
    api_key = config.api_key or getattr(holder, "_api_key", None)
    if not base_url or not api_key:
        raise ValueError("cannot tell the backend's base_url/api_key: set them in the config")
    return base_url.rstrip("/"), api_key


def runs_dir() -> Path:
    """Where recipes and notebooks write what they record (metrics, labels): $STEPWISE_HOME/runs,
    not the current folder, which for a notebook may be a source checkout."""
    from workbench.client.connection import stepwise_home

    return stepwise_home() / "runs"


def metrics_path_for(config: BaseConfig, recipe: str) -> Path:
    if config.metrics_path:
        return Path(config.metrics_path)
    return runs_dir() / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"


# ---------------------------------------------------------------------------------------------
# Data


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_prompts(path: str | None, default: list[str]) -> list[str]:
    """The prompts of a JSONL of {"prompt": ...} records, or `default` when there is no path."""
    return [r["prompt"] for r in read_jsonl(path)] if path else list(default)


def local_tokenizer(base_model: str = DEFAULT_MODEL):
    """The base model's tokenizer from this machine's model store (workbench.widgets.tokens.local_tokenizer)."""
    from workbench.widgets.tokens import local_tokenizer as load

    return load(base_model)


def token_ids(encoded) -> list[int]:
    """apply_chat_template answers a list or a BatchEncoding depending on the transformers version."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return [int(x) for x in encoded]


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The chat-formatted tokens of `messages`, ending where the assistant's next turn starts."""
    return token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def user_prompt(tokenizer, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return render_prompt(tokenizer, messages)


def chat_datum(tokenizer, messages: list[dict], train_on: str = "all_assistant",
               tools: list[dict] | None = None) -> types.Datum:
    """A next-token Datum over the whole conversation, weight 1 on assistant tokens only.

    train_on: "all_assistant" (every assistant turn) or "last_assistant" (the final one only).
    tools: JSON schemas offered in the prompt; assistant turns may then hold `tool_calls` and the
    conversation `role: tool` messages, all written in the template's tool format (or the Hermes
    fallback the server and workbench.recipes.episodes use), so a demonstration trains what a run samples.
    Each assistant turn's tokens are found by rendering the conversation up to it with and
    without it, so this works for any chat template whose renderings are prefixes of each other.
    """
    if train_on not in ("all_assistant", "last_assistant"):
        raise ValueError(f"train_on must be 'all_assistant' or 'last_assistant', not {train_on!r}")

    def render(turns: list[dict], add_generation_prompt: bool = False) -> list[int]:
        if tools is None:
            return token_ids(tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt))
        return tool_calls.render(tokenizer, turns, tools, add_generation_prompt=add_generation_prompt)

    full = render(messages)
    weights = np.zeros(len(full), dtype=np.float32)  # weight of each token as a *target*
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_turns:
        raise ValueError("the conversation has no assistant turn to train on")
    if train_on == "last_assistant":
        assistant_turns = assistant_turns[-1:]
    for i in assistant_turns:
        before = render(messages[:i], add_generation_prompt=True)
        upto = render(messages[: i + 1])
        if full[: len(before)] != before or full[: len(upto)] != upto:
            raise ValueError("the chat template does not render conversations as prefixes of each other")
        weights[len(before) : len(upto)] = 1.0
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.asarray(full[1:], dtype=np.int64)),
                        "weights": types.TensorData.from_numpy(weights[1:])},
    )


def rollout_datum(prompt: list[int], completion: list[int], sampler_logprobs, advantages,
                  sequence_id: str | None = None) -> types.Datum:
    """A policy-gradient Datum over prompt + completion for importance_sampling / ppo / cispo / dro.

    `advantages` is a number (one per sequence) or one value per completion token. Prompt
    positions get logprob 0 and advantage 0, so only the completion's tokens carry gradient.
    With the completion's `sequence_id` (from a sampler made with record_stability_info=True) the
    Datum also says where each token came from, which stable_reinforce needs: the input and the
    targets are the recorded sequence's prompt, then its sampled tokens (docs/tinker-surface.md).
    """
    tokens = list(prompt) + list(completion)
    n = len(tokens) - 1
    start = len(prompt) - 1  # the position whose target is the first completion token
    logprobs = np.zeros(n, dtype=np.float32)
    adv = np.zeros(n, dtype=np.float32)
    logprobs[start:] = np.asarray(sampler_logprobs, dtype=np.float32)
    adv[start:] = np.asarray(advantages, dtype=np.float32)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
                        "logprobs": types.TensorData.from_numpy(logprobs), "advantages": types.TensorData.from_numpy(adv)},
    )
    if sequence_id is None:
        return datum
    p, c = len(prompt), len(completion)
    sampled_input = [types.SampledProvenanceSpan(sequence_id=sequence_id, offset=0, length=c - 1)] if c > 1 else []
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sequence_id, offset=0, length=p)] + sampled_input,
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=p - 1),
                        types.SampledProvenanceSpan(sequence_id=sequence_id, offset=0, length=c)])


def as_numpy(tensor) -> np.ndarray:
    return tensor.to_numpy() if hasattr(tensor, "to_numpy") else np.asarray(tensor)


def weighted_nll(data: list[types.Datum], outputs: list[dict]) -> tuple[float, float]:
    """(sum of -logprob * weight, sum of weights) over a forward/forward_backward's outputs."""
    total, count = 0.0, 0.0
    for datum, out in zip(data, outputs):
        w = as_numpy(datum.loss_fn_inputs["weights"])
        total += float(-(as_numpy(out["logprobs"]) * w).sum())
        count += float(w.sum())
    return total, count


def batches(items: list, batch_size: int, rng: np.random.Generator) -> Iterator[list]:
    """An endless stream of batches: shuffle, cut, reshuffle every epoch."""
    if not items:
        raise ValueError("no data")
    size = min(batch_size, len(items))
    while True:
        order = rng.permutation(len(items))
        for start in range(0, len(order) - size + 1, size):  # a short last batch waits for the next epoch
            yield [items[i] for i in order[start : start + size]]


# ---------------------------------------------------------------------------------------------
# Learning rate


def lr_at(step: int, total_steps: int, base_lr: float, schedule: str = "linear", warmup_steps: int = 0,
          min_ratio: float = 0.0) -> float:
    """The learning rate of step `step` (0-based): warmup, then "constant", "linear" or "cosine"
    decay from base_lr down to base_lr * min_ratio at the last step."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= 1:
        return base_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1))
    if schedule == "linear":
        factor = 1.0 - progress
    elif schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule {schedule!r}: constant, linear or cosine")
    return base_lr * (min_ratio + (1.0 - min_ratio) * factor)


def adam(lr: float) -> types.AdamParams:
    return types.AdamParams(learning_rate=lr)


# ---------------------------------------------------------------------------------------------
# Metrics and progress


class MetricsLog:
    """Appends one JSON object per line: {"step": n, "time": seconds since start, **metrics}.

    `on_log(row)` is called with every row: a notebook passes e.g. `lambda row: dashboard.log(...)`
    to plot what the recipe computes locally (rewards, KL) next to the backend's loss."""

    def __init__(self, path: str | Path, on_log: Callable[[dict], None] | None = None):
        self.path = Path(path)
        self.on_log = on_log
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")
        self._start = time.monotonic()
        self.rows: list[dict] = []

    def log(self, step: int, **metrics: Any) -> dict:
        row = {"step": step, "time": round(time.monotonic() - self._start, 3)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.on_log is not None:
            self.on_log(row)
        return row

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def plot_to(dashboard, *names: str, tokenizer=None, run: str | None = None) -> Callable[[dict], None]:
    """An `on_step` callback that plots the named metrics of each logged row on a workbench.Dashboard,
    marks the steps a row says were skipped (`"skipped": why`: taken with nothing to train on) and
    those it flags (`"flags": [{"kind", "detail"}]`: the rl recipe's collapse and KL alerts), and shows
    the rollouts a row names (`"rollouts"`: the folder the rl recipe stores each step's groups in)
    below the plots, their tokens decoded with `tokenizer`. With `run` (the config's run_name), the
    metrics are that run's traces, so several runs overlay on one session dashboard."""

    def on_step(row: dict) -> None:
        values = {n: row[n] for n in names if isinstance(row.get(n), (int, float)) and math.isfinite(row[n])}
        if values:
            dashboard.log(row["step"], run=run, **values)
        if row.get("skipped"):
            dashboard.skip(row["step"], row["skipped"], run=run)
        for flag in row.get("flags") or ():
            dashboard.flag(row["step"], flag["kind"], flag["detail"], run=run)
        if row.get("rollouts"):
            dashboard.rollouts(row["rollouts"], tokenizer, run=run)

    return on_step


def _plain(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def progress_bar(total: int, desc: str, enabled: bool = True):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# Usage and the summary


def fetch_usage(base_url: str, api_key: str, **filters) -> dict:
    """GET /api/v1/usage with filters (training_run_id=..., session_id=...): the `totals` object."""
    params = {k: v for k, v in filters.items() if v is not None}
    response = httpx.get(f"{base_url}/api/v1/usage", params={**params, "limit": 1},
                         headers={"X-API-Key": api_key}, timeout=30)
    response.raise_for_status()
    return response.json()["totals"]


@dataclass
class Summary:
    """What a recipe run did. `cost` and `tokens` are the training run's (forward, forward_backward,
    optim, and the sampling done with its weights, its rollouts: GET /api/v1/usage?training_run_id=...);
    `session_cost`/`session_tokens` add everything else the run's session did (sampling the base
    model, reference logprobs, teacher logprobs)."""

    recipe: str
    training_run_id: str
    steps: int
    metric: str                 # the name of the recipe's headline metric
    initial: float              # its value at the start
    final: float                # and at the end
    tokens: int                 # training run: prefill + sample + train tokens
    cost: float                 # training run, USD
    session_id: str | None = None
    session_tokens: int | None = None
    session_cost: float | None = None
    metrics_path: str = ""
    checkpoints: list[str] = field(default_factory=list)
    sampler_path: str | None = None
    extra: dict = field(default_factory=dict)
    skipped_steps: int = 0      # of `steps`, taken with nothing to train on (an optim_step, no gradient)
    skipped_why: str = ""       # why, e.g. "every group tied"
    compared: str = ""          # what initial and final are, in words: "step 1 -> the mean of steps 10-12"
    # What this run spent: its session's usage at the end minus at the start of run(), so it counts the
    # training run and the session-side calls (base-model sampling, reference and teacher logprobs),
    # and nothing the session did before (the demo's RL run follows its SFT run in one session).
    spent: float | None = None  # USD; what estimate(config) predicts
    spent_tokens: dict = field(default_factory=dict)  # by meter: {"prefill": n, "sample": n, "train": n}
    # Progress in units of the recipe's choosing ("0.1 reward gained", "label"): cost_per_unit = spent / progress.
    progress_unit: str = ""
    progress: float = float("nan")

    @property
    def spend(self) -> float:
        """What the run cost: `spent` when known, else the whole session's cost, else the training run's."""
        return self.spent if self.spent is not None else self.session_cost if self.session_cost is not None else self.cost

    @property
    def cost_per_unit(self) -> float | None:
        """USD per unit of progress: what the run spent over the units it made; None when it made none."""
        return self.spend / self.progress if self.progress > 0 else None

    def __str__(self) -> str:
        skipped = (f" ({self.skipped_steps} skipped: {self.skipped_why}; nothing to train on, weights unchanged)"
                   if self.skipped_steps else "")
        lines = [
            f"{self.recipe}: {self.steps} steps on {self.training_run_id}{skipped}",
            f"  {self.metric}: {self.initial:.4g} -> {self.final:.4g}" + (f" ({self.compared})" if self.compared else ""),
            f"  training run: {self.tokens:,} tokens, ${self.cost:.6f}",
        ]
        if self.session_cost is not None:
            lines.append(f"  whole session (sampling included): {self.session_tokens:,} tokens, ${self.session_cost:.6f}")
        if self.spent is not None and self.spent != self.session_cost:
            lines.append(f"  this run (the session's spend while it ran): {sum(self.spent_tokens.values()):,} tokens, "
                         f"${self.spent:.6f}")
        if self.progress_unit:
            per = self.cost_per_unit
            lines.append(f"  cost per {self.progress_unit}: ${per:.6f} ({self.progress:.3g} of them for ${self.spend:.6f})"
                         if per is not None else f"  cost per {self.progress_unit}: none made ({self.metric} did not improve)")
        for key, value in self.extra.items():
            if not isinstance(value, (list, dict)):
                lines.append(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
        if self.checkpoints:
            lines.append(f"  checkpoints: {', '.join(self.checkpoints)}")
        if self.sampler_path:
            lines.append(f"  sampler weights: {self.sampler_path}")
        lines.append(f"  metrics: {self.metrics_path}")
        return "\n".join(lines)


def window_words(steps: int, window: int) -> str:
    """What before_after compares, in words."""
    last = f"step {steps}" if window == 1 else f"the mean of steps {steps - window + 1}-{steps}"
    return f"step 1 -> {last}"


def before_after(history: list[float], window: int = 3) -> tuple[float, float, int]:
    """(the first step's value, the mean of the last `window` steps, the window used).

    The first step's samples come from the initial weights, so its value is the "before"; the
    last steps are averaged because each step's value is measured on a small fresh batch."""
    if not history:
        return float("nan"), float("nan"), 0
    window = max(1, min(window, len(history) - 1))
    return float(history[0]), float(np.mean(history[-window:])), window


def _total_tokens(totals: dict) -> int:
    return int(totals["prefill_tokens"]) + int(totals["sample_tokens"]) + int(totals["train_tokens"])


def session_usage(config: BaseConfig, service_client: tinker.ServiceClient) -> dict | None:
    """The usage totals of the client's session so far (None without a session id): a run() reads them
    at its start, so that its summary can tell what the run itself spent."""
    session_id = session_id_of(service_client)
    return fetch_usage(*endpoint_of(config, service_client), session_id=session_id) if session_id else None


def summarize(recipe: str, config: BaseConfig, service_client: tinker.ServiceClient, training_client,
              steps: int, metric: str, initial: float, final: float, log: MetricsLog, start: dict | None = None,
              **kwargs) -> Summary:
    """Read the usage API for the run (and the session), build the Summary, print it if verbose.
    `start`: session_usage() at the start of the run, to count what the run spent."""
    run = fetch_usage(*endpoint_of(config, service_client), training_run_id=training_client.model_id)
    session = session_usage(config, service_client)
    if session and start:
        kwargs.update(spent=float(session["cost"]) - float(start["cost"]),
                      spent_tokens={kind: int(session[f"{kind}_tokens"]) - int(start[f"{kind}_tokens"]) for kind in KINDS})
    summary = Summary(
        recipe=recipe, training_run_id=training_client.model_id, steps=steps, metric=metric,
        initial=float(initial), final=float(final), tokens=_total_tokens(run), cost=float(run["cost"]),
        session_id=session_id_of(service_client),
        session_tokens=_total_tokens(session) if session else None,
        session_cost=float(session["cost"]) if session else None,
        metrics_path=str(log.path), **kwargs,
    )
    if config.verbose:
        print(summary, flush=True)
    return summary


# ---------------------------------------------------------------------------------------------
# A command line for any recipe: `python -m workbench.recipes.rl --steps 20 --loss-fn ppo`


def _arg_type(annotation):
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {"__builtins__": __builtins__, "typing": typing})  # noqa: S307 - our own annotations
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, pytypes.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0] if args else str
    return hint if hint in (int, float, str, bool) else str


def main(config_cls, run, argv: list[str] | None = None) -> Summary:
    """Parse --field-name options for `config_cls`, connect (the config's base_url/api_key, or
    the embedded backend through workbench.connect()), run the recipe and return its summary."""
    module = sys.modules[run.__module__]
    name = module.__spec__.name if module.__spec__ else run.__module__
    parser = argparse.ArgumentParser(prog=f"python -m {name}", description=(module.__doc__ or "").split("\n\n")[0],
                                     epilog="Without --base-url it uses the local backend (workbench.connect()), started if none runs.")
    for f in dataclasses.fields(config_cls):
        if not f.metadata.get("cli", True):  # a Python object (a function): set in code, not on the command line
            continue
        kind = _arg_type(f.type)
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes", "on"), default=None,
                                metavar="BOOL")
        else:
            parser.add_argument(flag, type=kind, default=None)
    options = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    config = config_cls(**options)
    if config.base_url:
        return run(config)
    from workbench.client.connect import connect, current

    service_client = connect()
    conn = current()
    config.base_url, config.api_key = conn.base_url, conn.api_key
    return run(config, service_client=service_client)
