"""What one step changed: probes measured after every optim_step of a training client.

    probes = Probes(tc, [("What is the capital of France?", "Paris."),   # a prompt with a reference answer
                         "Name a colour."])                              # a prompt alone
    display(probes)             # or dashboard.watch(probes_list, tc)
    for step in ...:
        tc.forward_backward(batch, "cross_entropy"); tc.optim_step(adam)   # each step is measured

How it works, and why: docs/workbench.md, "Inside the workbench, module by module", workbench/widgets/probes.py.
"""

from __future__ import annotations

import concurrent.futures
import html as html_lib
import threading
from typing import Any

import ipywidgets as w
import traitlets as t
from tinker import TrainingClient, types

from workbench.client import sdk_hooks
from workbench.client.connect import connection_of
from workbench.recipes.dpo import completion_datum, encode_pair
from workbench.widgets.compare import prompt_tokens
from workbench.recipes.common import as_numpy
from workbench.widgets.tokens import token_html, token_pieces


def normalize_probes(probes) -> list[dict]:
    """Each probe as {"prompt": ..., "reference": text or None}."""
    out = []
    for n, probe in enumerate(probes):
        if isinstance(probe, str):
            probe = {"prompt": probe, "reference": None}
        elif isinstance(probe, (tuple, list)):
            if len(probe) != 2:
                raise ValueError(f"probe {n}: a pair is (prompt, reference answer), got {len(probe)} items")
            probe = {"prompt": probe[0], "reference": probe[1]}
        elif isinstance(probe, dict) and "prompt" in probe:
            probe = {"prompt": probe["prompt"], "reference": probe.get("reference")}
        else:
            raise ValueError(f"probe {n}: give a prompt string, a (prompt, reference) pair or "
                             "{'prompt': ..., 'reference': ...}")
        if not isinstance(probe["prompt"], str) or not (probe["reference"] is None or isinstance(probe["reference"], str)):
            raise ValueError(f"probe {n}: the prompt and the reference are strings")
        out.append(probe)
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token sequences differ (the shorter one's end counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def marked_html(pieces: list[str], index: int | None) -> str:
    """Token texts with the one at `index` marked (the first that differs from the other answer)."""
    spans = [f'<mark class="wb-diverge" title="first token that differs">{html_lib.escape(p)}</mark>' if i == index
             else html_lib.escape(p) for i, p in enumerate(pieces)]
    if index is not None and index >= len(pieces):  # this answer ended where the other went on
        spans.append('<mark class="wb-diverge" title="this answer ended here">∎</mark>')
    return f'<span class="wb-answer" style="white-space:pre-wrap;font-family:monospace">{"".join(spans)}</span>'


class Probes(w.VBox):
    steps: t.List[int] = t.List()
    changes: t.List[dict] = t.List()
    answers: t.List[dict] = t.List()
    html = t.Unicode("")
    error = t.Unicode("")

    def __init__(self, training_client: TrainingClient, probes, *, connection=None, max_probes: int = 8,
                 max_tokens: int = 32, tokenizer=None, system: str | None = None):
        self.probes = normalize_probes(probes)
        if not self.probes:
            raise ValueError("Probes needs at least one probe")
        if len(self.probes) > max_probes:
            raise ValueError(f"{len(self.probes)} probes is more than max_probes={max_probes}: each is measured "
                             "after every step, and metered; pass a larger max_probes to allow more")
        self.training_client = training_client
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer if tokenizer is not None else training_client.get_tokenizer()
        self._refs, self._data, self._prompts = [], [], []
        for i, probe in enumerate(self.probes):
            if probe["reference"] is None:
                self._prompts.append((i, prompt_tokens(probe["prompt"], self.tokenizer, system)[1]))
                continue
            prompt_ids, full = encode_pair(probe["prompt"], probe["reference"], self.tokenizer)
            answer = full[len(prompt_ids):]
            if len(answer) > max_tokens:
                raise ValueError(f"probe {i}'s reference is {len(answer)} tokens, more than max_tokens={max_tokens}")
            self._refs.append((i, len(prompt_ids), answer))
            self._data.append(completion_datum(prompt_ids, full))
        self._greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
        self._history: list[dict] = []  # one measurement per step: {step, logprobs: [...], answers: [ids]}
        self._lock = threading.Lock()
        self._pending: list[concurrent.futures.Future] = []
        # One worker: measurements are collected, and so shown, in the order their steps were taken.
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepwise-probes")
        self._view = w.HTML()
        super().__init__(children=[self._view])
        self._view.value = self._render()
        self._step = self._start_step(connection)
        self._unhook = sdk_hooks.on_optim_step(training_client, self._on_optim_step)
        self.measure(self._step, wait=False)  # the "before"

    def _start_step(self, connection) -> int:
        from workbench.client.past_steps import current_step

        connection = connection or connection_of(self.training_client)
        if connection is None:
            return 0
        try:
            return current_step(self.training_client, connection=connection)
        except Exception:  # noqa: BLE001 - a backend that cannot say (a new run, or restarted): count from 0
            return 0

    # ---- measuring ------------------------------------------------------------------------------

    def _on_optim_step(self, training_client, future) -> None:
        self._step += 1
        self.measure(self._step, wait=False)

    def measure(self, step: int | None = None, *, wait: bool = True):
        """Measure the weights now (the requests go out on this thread, after whatever it sent before).
        `step` labels the measurement (default: the step the hook counted). Blocks until it is shown
        unless `wait=False`, which returns the background future instead."""
        step = self._step if step is None else int(step)
        forward = sdk_hooks.sdk_method(TrainingClient, "forward")  # not remembered as the loop's own call
        logprobs = forward(self.training_client, self._data, "cross_entropy") if self._data else None
        sampler = self.training_client.save_weights_and_get_sampling_client() if self._prompts else None
        job = self._worker.submit(self._collect, step, logprobs, sampler)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [job]
        if not wait:
            return job
        job.result()
        return self

    def wait(self, timeout: float | None = None) -> "Probes":
        """Wait until every measurement submitted so far is in and shown."""
        with self._lock:
            pending = list(self._pending)
        for job in pending:
            job.result(timeout=timeout)
        return self

    def _collect(self, step: int, logprobs_future, sampler_future) -> None:
        try:
            measured: dict[str, Any] = {"step": step, "logprobs": [], "answers": []}
            if logprobs_future is not None:
                outputs = logprobs_future.result().loss_fn_outputs
                for (_, prompt_len, answer), out in zip(self._refs, outputs):
                    values = as_numpy(out["logprobs"]).tolist()
                    # target position p predicts token p + 1: the answer's tokens start at prompt_len - 1
                    measured["logprobs"].append([float(v) for v in values[prompt_len - 1: prompt_len - 1 + len(answer)]])
            if sampler_future is not None:
                sampler = sampler_future.result()
                futures = [sampler.sample(types.ModelInput.from_ints(ids), 1, self._greedy) for _, ids in self._prompts]
                measured["answers"] = [[int(x) for x in f.result().sequences[0].tokens] for f in futures]
            self._history.append(measured)
            self._publish()
        except Exception as error:  # noqa: BLE001 - shown in the widget; the loop goes on
            self.error = f"measuring step {step}: {error!r}"
            self._view.value = self._render()
            raise

    # ---- state and rendering ------------------------------------------------------------------------

    def _publish(self) -> None:
        history = self._history
        first, latest = history[0], history[-1]
        previous = history[-2] if len(history) > 1 else None
        changes = []
        for k, (i, _, answer) in enumerate(self._refs):
            now = latest["logprobs"][k]
            delta = [a - b for a, b in zip(now, previous["logprobs"][k])] if previous else None
            sums = [sum(a - b for a, b in zip(h["logprobs"][k], g["logprobs"][k])) for g, h in zip(history, history[1:])]
            changes.append({"index": i, "prompt": self.probes[i]["prompt"], "reference": self.probes[i]["reference"],
                            "tokens": token_pieces(answer, self.tokenizer), "logprobs": now, "delta": delta,
                            "sums": sums, "total": sum(a - b for a, b in zip(now, first["logprobs"][k]))})
        answers = []
        for k, (i, _) in enumerate(self._prompts):
            before = (previous or latest)["answers"][k]
            after = latest["answers"][k]
            answers.append({"index": i, "prompt": self.probes[i]["prompt"],
                            "first": self.tokenizer.decode(first["answers"][k], skip_special_tokens=True),
                            "before": self.tokenizer.decode(before, skip_special_tokens=True),
                            "after": self.tokenizer.decode(after, skip_special_tokens=True),
                            "before_tokens": token_pieces(before, self.tokenizer),
                            "after_tokens": token_pieces(after, self.tokenizer),
                            "divergence": first_divergence(before, after)})
        with self.hold_trait_notifications():
            self.steps = [h["step"] for h in history]
            self.changes, self.answers, self.error = changes, answers, ""
        self.html = self._render()
        self._view.value = self.html

    def _render(self) -> str:
        if not self.steps:
            return f'<div class="wb-probes" style="font:12px sans-serif">measuring {len(self.probes)} probes…</div>'
        step = self.steps[-1]
        before = self.steps[-2] if len(self.steps) > 1 else None
        head = (f"<b>probes</b> · step {step}, the change since step {before}" if before is not None
                else f"<b>probes</b> · measured at step {step}; each optim_step from now on shows what it changed")
        blocks = []
        for c in self.changes:
            if c["delta"] is None:
                tokens = token_html(c["tokens"], c["logprobs"], "logprob", legend=True)
                facts = f"Σ logprob {sum(c['logprobs']):+.4g}"
            else:
                tokens = token_html(c["tokens"], c["delta"], "change", legend=True)
                facts = (f"Σ change this step {c['sums'][-1]:+.4g} · since step {self.steps[0]} {c['total']:+.4g}")
            blocks.append(f'<div class="wb-probe" data-index="{c["index"]}" style="margin:6px 0">'
                          f'<div style="color:#555">{html_lib.escape(c["prompt"])}</div>{tokens}'
                          f'<div class="wb-sum" style="color:#555;font-size:11px">{facts}</div></div>')
        for a in self.answers:
            d = a["divergence"]
            verdict = ("the same answer" if d is None else f"first differs at token {d}") if before is not None else ""
            blocks.append(
                f'<div class="wb-probe" data-index="{a["index"]}" style="margin:6px 0">'
                f'<div style="color:#555">{html_lib.escape(a["prompt"])} <i>(greedy answer)</i></div>'
                f"<div>before{f' (step {before})' if before is not None else ''}: "
                f"{marked_html(a['before_tokens'], d)}</div>"
                f"<div>after (step {step}): {marked_html(a['after_tokens'], d)}</div>"
                f'<div class="wb-sum" style="color:#555;font-size:11px">{verdict}</div></div>')
        error = (f'<div class="wb-error" style="color:#b00">{html_lib.escape(self.error)}</div>' if self.error else "")
        return f'<div class="wb-probes" style="font:12px sans-serif">{head}{"".join(blocks)}{error}</div>'

    def close(self) -> None:
        """Stop measuring (the optim_step listener goes) and close the widget."""
        if hasattr(self, "_unhook"):  # not when the constructor refused the probes (Widget.__del__ closes)
            self._unhook()
            self._worker.shutdown(wait=False)
        super().close()
