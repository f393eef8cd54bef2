"""LiveLabeler: label pairs while the model learns from your labels (human-in-the-loop DPO).

    live = workbench.LiveLabeler(training_client, prompts, update_every=4)   # objective="dpo"
    live                      # label with the keys shown; every 4 labels an update trains meanwhile
    live.summary()            # labels, updates, held-out margin gain, self-agreement
    live.export("prefs.jsonl")  # prompt/chosen/rejected JSONL for TRL or Argilla

The Labeler widget (labeler.py: the judgments, keys, undo, the labels file), fed one pair at a time
by workbench.recipes.live_preference.LiveLoop: pairs are sampled ahead from the run's latest weights and
shown most informative first; every `update_every` labels, and at once after an edit, a DPO update
runs on a background thread while the person goes on labelling; then the next pairs come from the
new weights. The widget's state is plain traitlets: `item_id` (the pair shown), `policy_version`
(the weights that sampled it), `current_version`, `updates_done`, `updating`, `status`, `chart`.

Every record also carries `policy_version`, `ordering` and `heldout` (every `holdout_every`-th
preference is kept out of training, to measure the margin on pairs the model did not train on).
An undo takes a label out of the records and of every later update; an update that already trained
on it is not reverted, and the undo says so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import traitlets as t

from workbench.recipes.live_preference import LiveLoop, config_from, informativeness
from workbench.recipes.preference_labels import REPEAT_SUFFIX, VERDICTS, is_training_pair
from workbench.recipes import common
from workbench.widgets.labeler import Labeler

ORDERING_WORDS = {
    "margin": "most informative first (the policy's smallest logprob margin)",
    "disagreement": "most informative first (where the policy and the starting weights disagree most)",
    "random": "random",
}


class LiveLabeler(Labeler):
    policy_version = t.Int(0).tag(sync=True)   # the weights that sampled the pair on show
    current_version = t.Int(0).tag(sync=True)  # the latest weights
    updates_done = t.Int(0).tag(sync=True)
    updating = t.Bool(False).tag(sync=True)
    status = t.Unicode("").tag(sync=True)
    ordering = t.Unicode("").tag(sync=True)
    counts = t.Dict().tag(sync=True)
    chart: t.List[dict] = t.List().tag(sync=True)  # one row per update (step 0: the start): heldout_gain, heldout_pairs, pairs, ...

    def __init__(self, training_client, prompts: list[str], update_every: int = 4, objective="dpo", *,
                 path: str | Path | None = None, heldout: Sequence[dict] = (), on_update=None,
                 metrics_path: str | Path | None = None, labeler: str | None = None, rubric: str = "",
                 keys: dict[str, str] | None = None, repeat_share: float = 0.1, repeat_gap: int = 3, **settings):
        """`settings` are workbench.recipes.live_preference.LiveConfig's fields (ordering, queue_size, max_tokens,
        learning_rate, beta, ...). `on_update(row)` sees each update's metrics row (common.plot_to for a
        Dashboard); the rows are also appended to `metrics_path`."""
        self.config = config_from(update_every=update_every, objective=objective, **settings)
        if not prompts:
            raise ValueError("LiveLabeler needs prompts to sample pairs for")
        self._loop: LiveLoop | None = None  # made last (Labeler.__init__ runs first)
        super().__init__([], path or common.runs_dir() / "preference-live-labels.jsonl", seed=self.config.seed,
                         labeler=labeler, rubric=rubric, keys=keys, repeat_share=repeat_share, repeat_gap=repeat_gap)
        self._labels_at_request = len(self._labels)  # labels resumed from the file trained nothing yet here
        self.live = True
        self.ordering = ORDERING_WORDS[self.config.ordering]
        self.metrics = common.MetricsLog(metrics_path or common.runs_dir() / f"preference-live-{time.strftime('%Y%m%d-%H%M%S')}.jsonl",
                                         on_update)
        self.on_label(self._after_label)
        self._loop = LiveLoop(training_client, prompts, self.config, records=lambda: list(self._labels),
                              heldout=list(heldout), on_change=self._loop_changed,
                              on_update=lambda row: self.metrics.log(**row))
        self._loop_changed()

    # ---- for scripts and tests ---------------------------------------------------------------------

    def wait_for_pair(self, timeout: float = 300.0) -> bool:
        """Block until a pair is on show (the queue may be refilling after an update)."""
        deadline = time.monotonic() + timeout
        while self.finished and time.monotonic() < deadline:
            self._loop_changed()
            time.sleep(0.1)
        return not self.finished

    def shown(self) -> dict | None:
        """The pair on show as the person sees it: prompt, a and b (texts and tokens, in display order),
        policy_version; None when no pair is on show."""
        with self._lock:
            if self.finished:
                return None
            item = self._by_id[self.item_id]
            left, right = self._sides[self.item_id]
            return {"id": item["id"], "prompt": item["prompt"], "policy_version": item["policy_version"],
                    "a": item["completions"][left], "b": item["completions"][right],
                    "a_tokens": item["completion_tokens"][left], "b_tokens": item["completion_tokens"][right]}

    def wait_for_updates(self, timeout: float = 600.0) -> bool:
        """Block until every update asked for so far is done."""
        return self.loop.wait(timeout)

    @property
    def loop(self) -> LiveLoop:
        if self._loop is None:
            raise RuntimeError("the LiveLabeler's loop is not made yet (its __init__ makes it last)")
        return self._loop

    def summary(self) -> dict:
        chart = self.loop.chart
        return {**super().summary(), "updates": self.loop.updates_done, "policy_version": self.loop.version,
                "heldout_gain": chart[-1]["heldout_gain"], "heldout_pairs": chart[-1]["heldout_pairs"],
                "trained": sorted(self.loop.fed)}

    def close(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:  # (a widget whose __init__ failed is closed too)
            loop.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        super().close()

    # ---- the Labeler's hooks ----------------------------------------------------------------------

    def _next_item_id(self) -> str | None:
        repeat = self._due_repeat()
        if repeat is not None or self._loop is None:
            return repeat
        item = self._loop.take()
        if item is None:
            return None
        self._by_id[item["id"]] = {**item, "models": [f"v{item['policy_version']}"] * 2}
        self.items.append(self._by_id[item["id"]])
        return item["id"]

    def _annotate(self, item: dict, choice: str) -> dict:
        record = {"policy_version": item.get("policy_version"), "ordering": self.config.ordering,
                  "informativeness": round(informativeness(item, self.config.ordering), 4) if "policy_logprob" in item else None}
        if self.config.holdout_every and VERDICTS[choice][0] is not None and not item.get("repeat_of"):  # an A/B preference
            preferences_so_far = sum(1 for r in self._labels if is_training_pair(r) and r["choice"] != "edit")
            record["heldout"] = (preferences_so_far + 1) % self.config.holdout_every == 0
        return record

    def _undo_message(self, record: dict) -> str:
        item_id, choice = record["item_id"], record["choice"]
        update = self._loop.fed.get(item_id) if self._loop else None
        if update is not None:
            return (f"Undid {choice} on {item_id}. It is out of the records, the export and every later update, but "
                    f"update {update} already trained on it and stays: updates are not reverted (fork the run at "
                    f"an earlier step to go back).")
        if self._loop is not None and item_id in self._loop.training_now:
            return (f"Undid {choice} on {item_id}. The update running now is training on it and will keep "
                    f"that; later updates will not use it.")
        return f"Undid {choice} on {item_id}: it had not trained yet, so nothing of it remains."

    def _put_back(self, item_id: str) -> None:
        if item_id and not item_id.endswith(REPEAT_SUFFIX) and item_id in self._by_id and self._loop is not None:
            self.items = [item for item in self.items if item["id"] != item_id]
            self._loop.put_back(self._by_id[item_id])
        else:
            super()._put_back(item_id)

    def _show(self, item_id: str | None, rationale: str = "") -> None:
        super()._show(item_id, rationale)
        item = self._by_id.get(item_id) if item_id else None
        with self.hold_sync():
            self.done = len({r["item_id"] for r in self._labels if not r.get("repeat_of")})
            self.counts = {c: n for c, n in super().summary()["counts"].items() if n}
            if item is not None:
                self.policy_version = item.get("policy_version", 0)
        self._loop_changed()  # the queue just lost a pair: its count on the widget follows

    # ---- the loop's side ------------------------------------------------------------------------------

    def _after_label(self, record: dict) -> None:
        if record["choice"] == "edit":
            self.loop.request_update("an edit")
        elif len(self._labels) - self._labels_at_request >= self.config.update_every:
            self.loop.request_update(f"{self.config.update_every} labels")
        else:
            return
        self._labels_at_request = len(self._labels)

    def _loop_changed(self) -> None:
        """The loop sampled, updated or failed (on its threads): show it, and a pair if none is on show."""
        loop = self._loop
        if loop is None:
            return
        with self._lock:
            if self.finished and loop.ready():
                self._show_next()
            with self.hold_sync():
                self.current_version = loop.version
                self.updates_done = loop.updates_done
                self.updating = loop.updating
                self.chart = list(loop.chart)
                queue = f"queue: {loop.ready()} pairs ready from weights v{loop.version}"
                if loop.sampling:
                    queue += ", sampling more"
                if self.finished:
                    queue = "Nothing to label this moment: the queue is empty; " + queue.split(": ", 1)[1]
                self.status = " · ".join(part for part in (queue, loop.status) if part)
