"""The preference labeler: a prompt and two completions side by side; a human picks the better one.

    lab = workbench.Labeler(pairs, path="labels.jsonl")   # pairs: dicts with prompt + two completions
    display(lab)                                           # click, or press 1/2/t/b/s/z
    lab.labels                  # a DataFrame of the current labels (lab.records: the same as dicts)
    lab.preferences()           # [{prompt, chosen, rejected}] for DPO / TRL
    lab.dpo_datums(tokenizer)   # tinker Datums for workbench.dpo.dpo_loss

Position bias: for each item a coin (seeded by `seed`) decides which completion is shown as A; the
mapping is logged with the label and model names are never shown. Every decision -- A, B, tie,
both bad, skip, and undo -- is appended to a JSONL file at once, so a kernel restart loses
nothing: a new Labeler on the same file replays it and resumes at the first unlabelled item.

The browser sends choices as anywidget custom messages ({"type": "label", "choice": "A", ...} or
{"type": "undo"}), handled by `_on_message`; `choose()` / `undo()` are the same actions from
Python. Items accepted: dicts with `prompt` and `completions` (two), or `a` and `b`, optionally
`models` (two) or `model_a`/`model_b`, an `id`, and `truncated` (two booleans: the sample stopped
at its token limit, mid-sentence; the labeler marks it so); (prompt, a, b) tuples; or a DataFrame.
"""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import json
import random
import threading
import time
from pathlib import Path
from typing import Callable

import anywidget
import pandas as pd
import traitlets as t

CHOICES = ("A", "B", "tie", "both_bad", "skip")


def _normalize(item, position: int) -> dict:
    """One item as {id, prompt, completions: [c0, c1], models: [m0, m1]}."""
    if isinstance(item, (tuple, list)):
        prompt, a, b = item
        item = {"prompt": prompt, "a": a, "b": b}
    item = dict(item)
    completions = item.get("completions") or [item.get("a", item.get("completion_a")), item.get("b", item.get("completion_b"))]
    if len(completions) != 2 or any(c is None for c in completions):
        raise ValueError(f"item {position} needs a prompt and two completions (`completions` or `a`/`b`)")
    models = item.get("models") or [item.get("model_a"), item.get("model_b")]
    key = json.dumps([item["prompt"], *completions], ensure_ascii=False)
    item_id = str(item.get("id") or hashlib.sha1(key.encode()).hexdigest()[:12])  # stable across restarts
    truncated = [bool(x) for x in (item.get("truncated") or [False, False])]
    return {"id": item_id, "prompt": str(item["prompt"]), "completions": [str(c) for c in completions],
            "models": list(models), "truncated": truncated}


def read_labels(path: str | Path) -> list[dict]:
    """Replay a labels file: the labels in force after every undo (an undo cancels the latest label
    of its item)."""
    labels: list[dict] = []
    path = Path(path)
    if not path.exists():
        return labels
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        if event.get("type") == "undo":
            for i in range(len(labels) - 1, -1, -1):
                if labels[i]["item_id"] == event["item_id"]:
                    del labels[i]
                    break
        else:
            labels.append(event)
    return labels


class Labeler(anywidget.AnyWidget):
    _esm = Path(__file__).with_name("labeler.js")
    # What the browser shows. text_a / text_b are already in display order (after the coin).
    item_id = t.Unicode("").tag(sync=True)
    prompt = t.Unicode("").tag(sync=True)
    text_a = t.Unicode("").tag(sync=True)
    text_b = t.Unicode("").tag(sync=True)
    cut_a = t.Bool(False).tag(sync=True)  # the completion shown as A was cut at its token limit
    cut_b = t.Bool(False).tag(sync=True)
    rationale = t.Unicode("").tag(sync=True)  # pre-filled after an undo
    done = t.Int(0).tag(sync=True)
    total = t.Int(0).tag(sync=True)
    finished = t.Bool(False).tag(sync=True)
    can_undo = t.Bool(False).tag(sync=True)
    last_action = t.Unicode("").tag(sync=True)
    labeler = t.Unicode("").tag(sync=True)

    def __init__(self, items, path: str | Path = "labels.jsonl", *, seed: int | None = None,
                 labeler: str | None = None):
        super().__init__()
        rows = items.to_dict("records") if isinstance(items, pd.DataFrame) else list(items)
        self.items = [_normalize(item, n) for n, item in enumerate(rows)]
        ids = [item["id"] for item in self.items]
        if len(set(ids)) != len(ids):
            raise ValueError("two items share an id (or the same prompt and completions); give each an `id`")
        self._by_id = {item["id"]: item for item in self.items}
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.labeler = labeler or getpass.getuser()
        self._rng = random.Random(seed)
        self._sides: dict[str, list[int]] = {}  # item id -> [completion shown as A, completion shown as B]
        self._labels = read_labels(self.path)  # resume: what earlier sessions recorded
        self._callbacks: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()
        self._shown_at = time.monotonic()
        self.total = len(self.items)
        self.on_msg(self._on_message)
        self._show_next()

    # ---- actions (from the browser's messages or from Python) ------------------------------------

    def _on_message(self, widget, content, buffers) -> None:
        kind = content.get("type")
        if kind == "undo":
            self.undo()
        elif kind == "label":
            # A press that raced an item change (double click) names the old item: drop it.
            if content.get("item_id") and content["item_id"] != self.item_id:
                return
            dwell = content.get("dwell_ms")
            self.choose(content["choice"], content.get("rationale", ""), dwell_s=dwell / 1000 if dwell else None)

    def choose(self, choice: str, rationale: str = "", *, dwell_s: float | None = None) -> dict | None:
        """Label the current item: "A", "B", "tie", "both_bad" or "skip". Returns the record."""
        choice = {"a": "A", "b": "B", "both bad": "both_bad"}.get(choice, choice)
        if choice not in CHOICES:
            raise ValueError(f"choice must be one of {CHOICES}, not {choice!r}")
        with self._lock:
            if self.finished:
                return None
            item = self._by_id[self.item_id]
            left, right = self._sides[item["id"]]
            preferred = {"A": left, "B": right}.get(choice)  # index into the item's own completions
            record = {
                "type": "label", "item_id": item["id"], "choice": choice, "preferred": preferred,
                "prompt": item["prompt"],
                "chosen": item["completions"][preferred] if preferred is not None else None,
                "rejected": item["completions"][1 - preferred] if preferred is not None else None,
                "completion_a": item["completions"][left], "completion_b": item["completions"][right],
                "sides": [left, right], "swapped": left == 1,
                "model_a": item["models"][left], "model_b": item["models"][right],
                "rationale": rationale or "", "labeler": self.labeler,
                "time": dt.datetime.now(dt.timezone.utc).isoformat(),
                "dwell_s": round(dwell_s if dwell_s is not None else time.monotonic() - self._shown_at, 3),
            }
            self._append(record)
            self._labels.append(record)
            self.last_action = f"{item['id']}: {choice}"
            self._show_next()
        for callback in self._callbacks:
            callback(record)
        return record

    def undo(self) -> dict | None:
        """Take back the latest label (it is logged as undone, not erased) and show that item again."""
        with self._lock:
            if not self._labels:
                return None
            record = self._labels.pop()
            self._append({"type": "undo", "item_id": record["item_id"], "labeler": self.labeler,
                          "time": dt.datetime.now(dt.timezone.utc).isoformat()})
            self._sides[record["item_id"]] = list(record["sides"])  # the same sides as before
            self.last_action = f"undid {record['item_id']}: {record['choice']}"
            self._show(record["item_id"], rationale=record.get("rationale", ""))
        return record

    def on_label(self, callback: Callable[[dict], None]) -> None:
        """Call `callback(record)` after every new label."""
        self._callbacks.append(callback)

    # ---- labels out -------------------------------------------------------------------------------

    @property
    def labels(self) -> pd.DataFrame:
        """The labels in force (undone ones removed), one row per label, in labelling order."""
        columns = ["item_id", "choice", "preferred", "prompt", "chosen", "rejected", "completion_a", "completion_b",
                   "sides", "swapped", "model_a", "model_b", "rationale", "labeler", "time", "dwell_s"]
        return pd.DataFrame([{c: r.get(c) for c in columns} for r in self._labels], columns=columns)

    @property
    def records(self) -> list[dict]:
        """The label records in force, as logged (the same list read_labels(path) replays)."""
        return list(self._labels)

    def preferences(self) -> list[dict]:
        """{prompt, chosen, rejected} for every A/B label (ties, both-bad and skips carry no preference)."""
        return [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
                for r in self._labels if r["choice"] in ("A", "B")]

    def dpo_datums(self, tokenizer, **kwargs) -> list:
        """The preferences as DPO inputs: see workbench.dpo.preference_datums."""
        from workbench.dpo import preference_datums

        return preference_datums(self.preferences(), tokenizer, **kwargs)

    def summary(self) -> dict:
        """Counts per choice, and how often each model won among A/B labels (when models are known)."""
        counts = {choice: 0 for choice in CHOICES}
        wins: dict[str, int] = {}
        for r in self._labels:
            counts[r["choice"]] += 1
            if r["choice"] in ("A", "B"):
                winner = r["model_a"] if r["choice"] == "A" else r["model_b"]
                wins[str(winner)] = wins.get(str(winner), 0) + 1
        return {"counts": counts, "done": self.done, "total": self.total, "wins": wins}

    # ---- internals ----------------------------------------------------------------------------------

    def _append(self, event: dict) -> None:
        with self.path.open("a") as f:  # one line per event, flushed at once: a crash loses nothing
            f.write(json.dumps(event, ensure_ascii=False) + "\n")

    def _labelled(self) -> set[str]:
        return {r["item_id"] for r in self._labels}

    def _show_next(self) -> None:
        labelled = self._labelled()
        upcoming = next((item["id"] for item in self.items if item["id"] not in labelled), None)
        self._show(upcoming)

    def _show(self, item_id: str | None, rationale: str = "") -> None:
        labelled = self._labelled()
        with self.hold_sync():  # the browser sees the new item in one message
            self.done = sum(1 for item in self.items if item["id"] in labelled)
            self.can_undo = bool(self._labels)
            self.finished = item_id is None
            if item_id is None:
                self.item_id = self.prompt = self.text_a = self.text_b = self.rationale = ""
                self.cut_a = self.cut_b = False
                return
            item = self._by_id[item_id]
            if item_id not in self._sides:  # the coin for this item, tossed once
                self._sides[item_id] = [1, 0] if self._rng.random() < 0.5 else [0, 1]
            left, right = self._sides[item_id]
            self.prompt = item["prompt"]
            self.text_a, self.text_b = item["completions"][left], item["completions"][right]
            self.cut_a, self.cut_b = item["truncated"][left], item["truncated"][right]
            self.rationale = rationale
            self.item_id = item_id  # last: the browser resets its timer on this change
            self._shown_at = time.monotonic()
