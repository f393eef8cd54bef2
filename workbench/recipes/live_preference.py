"""The live preference loop: pairs sampled from a run's latest weights, shown most informative
first, and every few labels a DPO update in the background. workbench.LiveLabeler is its widget.

    loop = LiveLoop(training_client, prompts, LiveConfig(update_every=4), records=lambda: labels)
    loop.take()                    # the most informative pair ready (a Labeler item), or None
    loop.request_update("4 labels")  # trains on the labelled pairs, off this thread
    loop.wait(timeout=300)         # until the requested updates are done (tests, scripts)

How it works, and why: docs/workbench.md, "Inside the workbench, module by module",
workbench/recipes/live_preference.py.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
from tinker import types

from workbench.recipes.dpo import answer_ids, completion_datum, with_confidence
from workbench.recipes.preference_labels import confidence, is_training_pair
from workbench.recipes import common
from workbench.recipes.preference import answer_logprobs, make_loss, margin_of, sample_candidates

if TYPE_CHECKING:
    from tinker import SamplingClient

ORDERINGS = ("margin", "disagreement", "random")


@dataclass
class LiveConfig:
    update_every: int = 4          # labels per update (an edit updates at once)
    objective: object = "dpo"      # "dpo", or a forward_backward_custom loss (data, logprobs_list) -> (loss, metrics)
    beta: float = 0.1
    learning_rate: float = 1e-3
    steps_per_update: int = 1
    pairs_per_update: int = 8
    ordering: str = "margin"       # margin | disagreement | random (docs/workbench.md, "Inside the workbench")
    queue_size: int = 4            # pairs sampled ahead
    max_tokens: int = 48
    temperature: float = 0.9
    instruction: str = " Answer in one sentence."  # appended to every prompt: answers short enough to read whole
    holdout_every: int = 4         # every n-th preference is held out to measure generalisation; 0: none
    seed: int = 0

    def __post_init__(self):
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, not {self.ordering!r}")
        if self.objective != "dpo" and not callable(self.objective):
            raise ValueError("objective is 'dpo' or a loss function (data, logprobs_list) -> (loss, metrics)")
        for name in ("update_every", "steps_per_update", "pairs_per_update", "queue_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")


def margin(values) -> float:
    return float(values[0] - values[1])


def informativeness(item: dict, ordering: str) -> float:
    """How much labelling `item` should teach (higher first); see docs/workbench.md, "Inside the workbench"."""
    if ordering == "margin":
        return -abs(margin(item["policy_logprob"]))
    if ordering == "disagreement":
        return abs(margin(item["policy_logprob"]) - margin(item["ref_logprob"])) - 1e-6 * abs(margin(item["policy_logprob"]))
    return item["coin"]


def order(items: list[dict], ordering: str) -> list[dict]:
    """`items` most informative first."""
    return sorted(items, key=lambda item: -informativeness(item, ordering))


class LiveLoop:
    def __init__(self, training_client, prompts: list[str], config: LiveConfig,
                 records: Callable[[], list[dict]], heldout: Sequence[dict] = (),
                 on_change: Callable[[], None] | None = None, on_update: Callable[[dict], object] | None = None):
        if not prompts:
            raise ValueError("LiveLoop needs prompts to sample pairs for")
        self.tc, self.config, self.prompts = training_client, config, list(prompts)
        self.tokenizer = training_client.get_tokenizer()
        self._records, self._heldout = records, list(heldout)
        self._on_change, self._on_update = on_change, on_update
        self.version = 0               # the latest weights' version
        self.updates_done = 0
        self.updating = False
        self.sampling = False          # a queue refill is under way
        self.status = "starting: saving weights v0 for sampling..."  # the latest event, in words
        self.error = ""
        # One row per update (its metrics; row 0 is the start): the widget's chart and on_update's rows.
        self.chart: list[dict] = [{"step": 0, "heldout_gain": 0.0, "heldout_pairs": len(self._heldout), "pairs": 0}]
        self.fed: dict[str, int] = {}  # item id -> the update that first trained its pair
        self.training_now: set[str] = set()
        self._queue: list[dict] = []
        self._items: dict[str, dict] = {}  # every pair sampled: labels find their tokens here
        self._ref: dict[tuple, np.ndarray] = {}  # full tokens -> the reference's logprobs of its targets
        self._sampled = 0
        self._rng = random.Random(config.seed)
        self._cv = threading.Condition()
        self._requests: queue.Queue = queue.Queue()
        self._pending = 0
        self._closed = threading.Event()
        self._sampler: SamplingClient | None = None
        self._reference: SamplingClient | None = None  # the v0 sampler, once made (then kept)
        self._threads = [threading.Thread(target=self._sample_forever, name="live-sampler", daemon=True),
                         threading.Thread(target=self._update_forever, name="live-updater", daemon=True)]
        for thread in self._threads:
            thread.start()

    # ---- what the widget calls --------------------------------------------------------------------

    def take(self) -> dict | None:
        """The most informative pair sampled by the latest weights, off the queue; None when empty."""
        with self._cv:
            if not self._queue:
                return None
            best = order(self._queue, self.config.ordering)[0]
            self._queue.remove(best)
            self._cv.notify_all()  # room in the queue: sample another
        return best

    def put_back(self, item: dict) -> None:
        """A pair taken but not labelled (an undo showed an older one instead): back in the queue."""
        with self._cv:
            if item["policy_version"] == self.version and all(queued is not item for queued in self._queue):
                self._queue.append(item)

    def ready(self) -> int:
        """How many pairs are sampled and waiting."""
        with self._cv:
            return len(self._queue)

    def request_update(self, reason: str) -> None:
        with self._cv:
            self._pending += 1
        self._requests.put(reason)
        self._changed()

    def wait(self, timeout: float = 600.0) -> bool:
        """Block until every requested update is done; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._pending and time.monotonic() < deadline:
                self._cv.wait(timeout=0.5)
            return not self._pending

    def close(self) -> None:
        self._closed.set()
        self._requests.put(None)
        with self._cv:
            self._cv.notify_all()

    # ---- sampling, ahead of the person --------------------------------------------------------------

    def _sample_forever(self) -> None:
        try:
            # The reference is saved under a name: an unnamed sampler snapshot is evicted once a few
            # newer ones exist (the backend keeps the newest 4 per run), and v0 is needed all session.
            name = f"live-reference-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
            path = self.tc.save_weights_for_sampler(name).result().path
            self._sampler = self._reference = self.tc.create_sampling_client(path).result()
            self.status = ""
        except Exception as error:  # noqa: BLE001 - shown on the widget; nothing else to do without a sampler
            self.error = self.status = f"could not get a sampler for weights v0: {error}"
            self._changed()
            return
        delay = 1.0
        while not self._closed.is_set():
            with self._cv:
                while not self._closed.is_set() and len(self._queue) >= self.config.queue_size:
                    self._cv.wait()
                want, sampler, version = self.config.queue_size - len(self._queue), self._sampler, self.version
                self.sampling = True
            self._changed()
            try:
                items = self._sample(sampler, version, want)
                delay = 1.0
            except Exception as error:  # noqa: BLE001 - a backend hiccup: say so, retry slower
                self.sampling = False
                self.error = self.status = f"sampling failed ({error}); retrying in {delay:.0f} s"
                self._changed()
                self._closed.wait(delay)
                delay = min(delay * 2, 30.0)
                continue
            with self._cv:
                if version == self.version:  # else an update landed meanwhile: these pairs are stale
                    self._queue.extend(items)
                self.sampling = False
                if self.error:
                    self.error = self.status = ""
            self._changed()

    def _sample(self, sampler, version: int, want: int) -> list[dict]:
        """`want` pairs from `sampler` (weights `version`), on the next prompts in turn."""
        first, self._sampled = self._sampled, self._sampled + want
        prompts = [self.prompts[n % len(self.prompts)] for n in range(first, first + want)]
        items = sample_candidates(sampler, self.tokenizer, prompts, self.config, first=first)
        for item in items:
            tokens, answers = item["prompt_tokens"], item["completion_tokens"]
            item.update(id=f"v{version}-{item['id']}", policy_version=version, coin=self._rng.random(),
                        policy_logprob=[float(np.sum(lp)) for lp in item["completion_logprobs"]])
            if version == 0:  # the sampler's logprobs are the reference's
                for answer, logprobs in zip(answers, item["completion_logprobs"]):
                    self._ref[tuple(tokens + answer)] = self._aligned(tokens, np.asarray(logprobs, dtype=np.float32))
            if self.config.ordering == "disagreement":
                refs = self._reference_logprobs([(tokens, a) for a in answers])
                item["ref_logprob"] = [float(r.sum()) for r in refs]
            self._items[item["id"]] = item
        return items

    # ---- the reference's logprobs ---------------------------------------------------------------------

    @staticmethod
    def _aligned(prompt: list[int], answer_logprobs: np.ndarray) -> np.ndarray:
        """An answer's logprobs placed at its targets' positions of a completion_datum (0 elsewhere)."""
        out = np.zeros(len(prompt) + len(answer_logprobs) - 1, dtype=np.float32)
        out[len(prompt) - 1:] = answer_logprobs
        return out

    def _reference_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
        """The reference's (v0's) logprobs of each (prompt, answer), aligned to its datum's targets;
        a prefill on the reference sampler for those not known yet (metered as prefill tokens)."""
        keys = [tuple(p + a) for p, a in pairs]
        missing = {k: self._reference_sampler().compute_logprobs(types.ModelInput.from_ints(list(k)))
                   for k in dict.fromkeys(keys) if k not in self._ref}
        for key, future in missing.items():
            logprobs = np.asarray([0.0 if x is None else x for x in future.result()[1:]], dtype=np.float32)
            self._ref[key] = logprobs  # position i predicts token i + 1, like the datum's targets
        return [self._ref[k] * (np.arange(len(self._ref[k])) >= len(p) - 1) for k, (p, _) in zip(keys, pairs)]

    def _reference_sampler(self) -> SamplingClient:
        """The v0 sampler: made before the first pair is sampled, so before any logprobs are asked of it."""
        if self._reference is None:
            raise RuntimeError("no sampler for weights v0, the reference, yet")
        return self._reference

    # ---- labels into pairs of tokens ------------------------------------------------------------------

    def pair_tokens(self, record: dict) -> tuple[list[int], list[int], list[int]]:
        """(prompt, chosen, rejected) tokens of a label: the sampled tokens themselves where the pair
        was sampled here, the text encoded where it was written (an edit) or read from a file."""
        key = record.get("repeat_of") or record.get("item_id")
        item = self._items.get(key) if key is not None else None
        if item is None:
            prompt = common.user_prompt(self.tokenizer, record["prompt"])
            return prompt, answer_ids(record["chosen"], self.tokenizer), answer_ids(record["rejected"], self.tokenizer)
        answers = item["completion_tokens"]
        if record.get("choice") == "edit":
            return item["prompt_tokens"], answer_ids(record["chosen"], self.tokenizer), answers[record["edited"]]
        return item["prompt_tokens"], answers[record["preferred"]], answers[1 - record["preferred"]]

    def datums(self, records: list[dict]) -> list[types.Datum]:
        """[chosen0, rejected0, ...] with the reference's logprobs and each pair's confidence."""
        tokens = [self.pair_tokens(r) for r in records]
        answers = [(p, a) for p, chosen, rejected in tokens for a in (chosen, rejected)]
        refs = self._reference_logprobs(answers)
        data = []
        for (prompt, answer), ref in zip(answers, refs):
            datum = completion_datum(prompt, prompt + answer)
            data.append(types.Datum(model_input=datum.model_input,
                                    loss_fn_inputs={**datum.loss_fn_inputs, "ref_logprobs": types.TensorData.from_numpy(ref)}))
        for n, record in enumerate(records):
            with_confidence(data[2 * n], confidence(record))
        return data

    # ---- updates, off the widget's thread --------------------------------------------------------------

    def _update_forever(self) -> None:
        while True:
            reason = self._requests.get()
            if reason is None or self._closed.is_set():
                return
            try:
                self._update(reason)
            except Exception as error:  # noqa: BLE001 - shown on the widget; the next update tries again
                self.error = self.status = f"update {self.updates_done + 1} failed: {error}"
            finally:
                with self._cv:
                    self._pending -= 1
                    self.updating = False
                    self.training_now = set()
                    self._cv.notify_all()
                self._changed()

    def _update(self, reason: str) -> None:
        c = self.config
        while self._reference is None and not self._closed.is_set() and not self.error:
            self._closed.wait(0.2)  # the v0 sampler (the reference) is still being made
        if self._reference is None:
            raise RuntimeError(f"no sampler for weights v0, the reference: {self.error or 'the loop was closed'}")
        labels = [r for r in self._records() if is_training_pair(r)]
        train = [r for r in labels if not r.get("heldout")]
        if not train:
            self.status = f"update skipped ({reason}): no label says which answer is better yet"
            return
        fresh = [r for r in train if r["item_id"] not in self.fed]
        again = [r for r in reversed(train) if r["item_id"] in self.fed]
        batch = (fresh + again)[: c.pairs_per_update]
        number = self.updates_done + 1
        with self._cv:
            self.updating, self.training_now = True, {r["item_id"] for r in batch}
        self._changed()
        data = self.datums(batch)
        loss_fn = c.objective if callable(c.objective) else make_loss(c.beta)  # dpo_loss + the raw margin
        metrics: dict = {}
        for _ in range(c.steps_per_update):
            failures: list[Exception] = []
            metrics = self.tc.forward_backward_custom(data, _guarded(loss_fn, failures)).result().metrics
            if failures:  # no optimizer step: the weights and the optimizer state stay as they were
                raise RuntimeError(f"the objective raised {type(failures[0]).__name__}: {failures[0]}") from failures[0]
            self.tc.optim_step(common.adam(c.learning_rate)).result()
        sampler = self.tc.save_weights_and_get_sampling_client().result()
        with self._cv:
            self.version, self._sampler = number, sampler
            self._queue = []  # sampled by older weights: the next pairs come from these
            for r in batch:
                self.fed.setdefault(r["item_id"], number)
            self.updates_done = number
            self._cv.notify_all()
        heldout = [r for r in labels if r.get("heldout")] + self._heldout
        gain, policy_margin = self._heldout_margins(heldout)
        row = {"step": number, "reason": reason, "pairs": len(batch), "labels": len(self._records()),
               "dpo_loss": metrics.get("dpo_loss:mean"), "accuracy": metrics.get("accuracy:mean"),
               "batch_logprob_margin": metrics.get("logprob_margin:mean"), "heldout_gain": gain,
               "heldout_margin": policy_margin, "heldout_pairs": len(heldout),
               "train_tokens": sum(d.model_input.length for d in data) * c.steps_per_update}
        self.chart = self.chart + [row]
        self.status = f"update {number} done ({reason}; {len(batch)} pairs, {len(fresh[: c.pairs_per_update])} new)"
        if self._on_update is not None:
            self._on_update(row)

    def _heldout_margins(self, records: list[dict]) -> tuple[float | None, float | None]:
        """(mean margin gain over v0, mean margin now) of the held-out pairs; (None, None) without any."""
        if not records:
            return None, None
        data = self.datums(records)
        now = margin_of(self.tc, data)  # a forward at the current weights
        start = answer_logprobs(data, [d.loss_fn_inputs["ref_logprobs"] for d in data])
        return now - float(np.mean(start[0::2] - start[1::2])), now

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:  # noqa: BLE001 - a display problem must not stop sampling or training
                pass


def _guarded(loss_fn, failures: list):
    """`loss_fn` that, instead of raising, notes the error and returns a zero loss: an exception inside
    forward_backward_custom would leave the SDK's TrainingClient unusable ("poisoned") for the rest of
    the session; a zero loss sends zero gradients, and the caller skips the optimizer step."""

    def guarded(data, logprobs_list):
        try:
            return loss_fn(data, logprobs_list)
        except Exception as error:  # noqa: BLE001 - the caller raises it, after the request is done
            failures.append(error)
            return sum((logprobs * 0.0).sum() for logprobs in logprobs_list), {}

    return guarded


def config_from(**settings) -> LiveConfig:
    """A LiveConfig from keyword settings, naming any that is not one of its fields."""
    fields = {f.name for f in dataclasses.fields(LiveConfig)}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise TypeError(f"unknown settings {unknown}; LiveConfig has {sorted(fields)}")
    return LiveConfig(**settings)
