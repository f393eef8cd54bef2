"""The preference labeler: a prompt and two completions side by side; a human judges them.

    lab = workbench.Labeler(pairs, path="labels.jsonl")   # pairs: dicts with prompt + two completions
    display(lab)                                           # click, or press the keys shown on it
    lab.labels                  # a DataFrame of the current labels (lab.records: the same as dicts)
    lab.preferences()           # [{prompt, chosen, rejected, strength}] for DPO / TRL
    lab.export("prefs.jsonl")   # the same as prompt/chosen/rejected JSONL (workbench.recipes.preference_labels)
    lab.dpo_datums(tokenizer)   # tinker Datums for workbench.recipes.dpo.dpo_loss

How it works, and why: docs/workbench.md, "Inside the workbench, module by module", workbench/widgets/labeler.py.
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

from workbench.recipes import preference_labels
from workbench.recipes.preference_labels import CHOICES, REPEAT_SUFFIX, VERDICTS

# key (as KeyboardEvent.key, "Shift+" for a shifted non-character key) -> action
KEYS = {
    "1": "A", "ArrowLeft": "A", "Shift+ArrowLeft": "A_slightly",
    "2": "B", "ArrowRight": "B", "Shift+ArrowRight": "B_slightly",
    "t": "tie", "b": "both_bad", "s": "skip", " ": "skip", "e": "edit", "z": "undo", "Backspace": "undo",
}
ACTIONS = (*CHOICES, "undo", *(f"rate:{n}" for n in range(1, 6)))


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
    message = t.Unicode("").tag(sync=True)  # what the last action did, in words (an undo's consequences)
    labeler = t.Unicode("").tag(sync=True)
    keymap = t.Dict().tag(sync=True)  # key -> action (KEYS, with the caller's rebindings)
    rubric = t.Unicode("").tag(sync=True)  # the 1-5 rating's one-line rubric; "" hides the rating
    self_agreement = t.Unicode("").tag(sync=True)  # "3 of 4 repeats agreed" once repeats were judged
    live = t.Bool(False).tag(sync=True)  # LiveLabeler: the front end shows the policy and the updates

    def __init__(self, items, path: str | Path = "labels.jsonl", *, seed: int | None = None,
                 labeler: str | None = None, rubric: str = "", keys: dict[str, str] | None = None,
                 repeat_share: float = 0.0, repeat_gap: int = 3):
        super().__init__()
        rows = items.to_dict("records") if isinstance(items, pd.DataFrame) else list(items)
        self.items = [_normalize(item, n) for n, item in enumerate(rows)]
        ids = [item["id"] for item in self.items]
        if len(set(ids)) != len(ids):
            raise ValueError("two items share an id (or the same prompt and completions); give each an `id`")
        if not 0.0 <= repeat_share <= 1.0:
            raise ValueError(f"repeat_share is a share of pairs, between 0 and 1, not {repeat_share}")
        unknown = {k: a for k, a in (keys or {}).items() if a not in ACTIONS}
        if unknown:
            raise ValueError(f"keys: unknown actions {unknown}; the actions are {', '.join(ACTIONS)}")
        self._by_id = {item["id"]: item for item in self.items}
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.labeler = labeler or getpass.getuser()
        self.rubric = rubric
        self.keymap = {**KEYS, **(keys or {})}
        self._rng = random.Random(seed)
        self._repeat_rng = random.Random(f"{seed}-repeats")  # its own coin: repeats leave the sides' coins alone
        self.repeat_share, self.repeat_gap = repeat_share, repeat_gap
        self._repeats: list[tuple[int, str]] = []  # (shown once this many labels are in, repeat id)
        self._sides: dict[str, list[int]] = {}  # item id -> [completion shown as A, completion shown as B]
        self._labels = read_labels(self.path)  # resume: what earlier sessions recorded
        self._callbacks: list[Callable[[dict], None]] = []
        self._lock = threading.RLock()
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
            self.choose(content["choice"], content.get("rationale", ""), rating=content.get("rating"),
                        dwell_s=dwell / 1000 if dwell else None)
        elif kind == "edit":
            if content.get("item_id") and content["item_id"] != self.item_id:
                return
            self.edit(content.get("side", "A"), content.get("text", ""), content.get("rationale", ""))

    def choose(self, choice: str, rationale: str = "", *, rating: int | None = None,
               dwell_s: float | None = None) -> dict | None:
        """Judge the current item: "A", "A_slightly", "tie", "B_slightly", "B", "both_bad" or "skip",
        optionally with a 1-5 `rating` (of the pair as the rubric asks). Returns the record."""
        choice = {"a": "A", "b": "B", "both bad": "both_bad"}.get(choice, choice)
        if choice not in CHOICES or choice == "edit":
            raise ValueError(f"choice must be one of {[c for c in CHOICES if c != 'edit']}, not {choice!r} "
                             "(an edit is labeler.edit(side, text))")
        if rating is not None and (not isinstance(rating, int) or not 1 <= rating <= 5):
            raise ValueError(f"rating is 1 to 5 (or None), not {rating!r}")
        side, strength = VERDICTS[choice]
        return self._record(choice, rationale, side=side, strength=strength, rating=rating, dwell_s=dwell_s)

    def edit(self, side: str, text: str, rationale: str = "") -> dict | None:
        """The person rewrote the answer shown as `side` ("A" or "B") into `text`: the record is the
        pair "text beats that answer" (a clear preference)."""
        if side not in ("A", "B"):
            raise ValueError(f"side is 'A' or 'B', not {side!r}")
        if not text.strip():
            raise ValueError("the edited answer is empty: write the answer you would want, or press Esc")
        return self._record("edit", rationale, side=None, strength="clear", edit=(side, text))

    def _record(self, choice: str, rationale: str, *, side: str | None, strength: str | None,
                rating: int | None = None, dwell_s: float | None = None, edit: tuple[str, str] | None = None):
        with self._lock:
            if self.finished:
                return None
            item = self._by_id[self.item_id]
            left, right = self._sides[item["id"]]
            preferred = {"A": left, "B": right}.get(side) if side is not None else None  # index into the item's own completions
            chosen = item["completions"][preferred] if preferred is not None else None
            rejected = item["completions"][1 - preferred] if preferred is not None else None
            if edit is not None:
                edited = left if edit[0] == "A" else right
                chosen, rejected = edit[1], item["completions"][edited]
            if chosen is not None and chosen == rejected:
                self.message = "the edit is the answer as it was: change it, or press Esc"
                return None
            record = {
                "type": "label", "item_id": item["id"], "choice": choice, "strength": strength,
                "preferred": preferred, "prompt": item["prompt"], "chosen": chosen, "rejected": rejected,
                "completion_a": item["completions"][left], "completion_b": item["completions"][right],
                "sides": [left, right], "swapped": left == 1,
                "model_a": item["models"][left], "model_b": item["models"][right],
                "rating": rating, "rationale": rationale or "", "labeler": self.labeler,
                "time": dt.datetime.now(dt.timezone.utc).isoformat(),
                "dwell_s": round(dwell_s if dwell_s is not None else time.monotonic() - self._shown_at, 3),
                **({"edited": edited} if edit is not None else {}),
                **({"repeat_of": item["repeat_of"]} if item.get("repeat_of") else {}),
                **self._annotate(item, choice),
            }
            self._append(record)
            self._labels.append(record)
            self._maybe_repeat(record)
            self.last_action = f"{item['id']}: {choice}"
            self.message = ""
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
            self._repeats = [(due, rid) for due, rid in self._repeats if rid != record["item_id"] + REPEAT_SUFFIX]
            self._sides[record["item_id"]] = list(record["sides"])  # the same sides as before
            self.last_action = f"undid {record['item_id']}: {record['choice']}"
            self.message = self._undo_message(record)
            self._put_back(self.item_id)
            self._show(record["item_id"], rationale=record.get("rationale", ""))
        return record

    def on_label(self, callback: Callable[[dict], None]) -> None:
        """Call `callback(record)` after every new label."""
        self._callbacks.append(callback)

    # ---- labels out -------------------------------------------------------------------------------

    @property
    def labels(self) -> pd.DataFrame:
        """The labels in force (undone ones removed), one row per label, in labelling order."""
        columns = ["item_id", "choice", "strength", "preferred", "prompt", "chosen", "rejected", "completion_a",
                   "completion_b", "sides", "swapped", "model_a", "model_b", "rating", "rationale", "labeler", "time",
                   "dwell_s", "repeat_of"]
        return pd.DataFrame([{c: r.get(c) for c in columns} for r in self._labels], columns=columns)

    @property
    def records(self) -> list[dict]:
        """The label records in force, as logged (the same list read_labels(path) replays)."""
        return list(self._labels)

    def preferences(self) -> list[dict]:
        """{prompt, chosen, rejected, strength} for every label that says which answer is better (A or
        B, clearly or slightly, and edits); ties, both-bad, skips and hidden repeats carry none."""
        return [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"],
                 "strength": r.get("strength") or "clear"}
                for r in self._labels if preference_labels.is_training_pair(r)]

    def export(self, path: str | Path) -> int:
        """The preferences as prompt/chosen/rejected JSONL (TRL, Hugging Face datasets, Argilla);
        returns how many pairs were written. workbench.recipes.preference_labels.import_jsonl reads it back."""
        return preference_labels.export_jsonl(self._labels, path)

    def dpo_datums(self, tokenizer, **kwargs) -> list:
        """The preferences as DPO inputs: see workbench.recipes.dpo.preference_datums."""
        from workbench.recipes.dpo import preference_datums

        return preference_datums(self.preferences(), tokenizer, **kwargs)

    def summary(self) -> dict:
        """Counts per choice, how often each model won among A/B labels (when models are known), and
        the person's self-agreement on hidden repeats (workbench.recipes.preference_labels.self_agreement)."""
        counts = {choice: 0 for choice in CHOICES}
        wins: dict[str, int] = {}
        for r in self._labels:
            counts[r["choice"]] += 1
            side = VERDICTS[r["choice"]][0]
            if side is not None and not r.get("repeat_of"):
                winner = r["model_a"] if side == "A" else r["model_b"]
                wins[str(winner)] = wins.get(str(winner), 0) + 1
        return {"counts": counts, "done": self.done, "total": self.total, "wins": wins,
                "self_agreement": preference_labels.self_agreement(self._labels)}

    # ---- what a subclass changes (workbench.LiveLabeler) -------------------------------------------

    def _next_item_id(self) -> str | None:
        """The item to show next: a hidden repeat that is due, else the first unlabelled item."""
        repeat = self._due_repeat()
        if repeat is not None:
            return repeat
        labelled = self._labelled()
        return next((item["id"] for item in self.items if item["id"] not in labelled), None)

    def _annotate(self, item: dict, choice: str) -> dict:
        """Extra fields for the record of a label on `item`."""
        return {}

    def _undo_message(self, record: dict) -> str:
        return f"Undid {record['choice']} on {record['item_id']}: it is shown again."

    def _put_back(self, item_id: str) -> None:
        """An undo replaces the item on show, `item_id`: a fixed list shows it again anyway, being
        unlabelled; a repeat goes back to the front of the repeats."""
        if item_id.endswith(REPEAT_SUFFIX):
            self._repeats.insert(0, (0, item_id))

    # ---- hidden repeats -------------------------------------------------------------------------------

    def _maybe_repeat(self, record: dict) -> None:
        """Maybe schedule a repeat of the pair just judged (not of a repeat, an edit or a skip)."""
        if record.get("repeat_of") or preference_labels.verdict(record) is None or not self.repeat_share:
            return
        if self._repeat_rng.random() < self.repeat_share:
            self._repeats.append((len(self._labels) + self.repeat_gap, record["item_id"] + REPEAT_SUFFIX))

    def _due_repeat(self) -> str | None:
        for entry in list(self._repeats):
            due, repeat_id = entry
            if len(self._labels) >= due:
                self._repeats.remove(entry)
                if self._item(repeat_id) is None:
                    continue  # its first showing is not known here
                self._sides.setdefault(repeat_id, self._sides[repeat_id[: -len(REPEAT_SUFFIX)]][::-1])  # swapped
                return repeat_id
        return None

    def _item(self, item_id: str) -> dict | None:
        """The item of an id; a repeat's is its first showing's, made on first use."""
        if item_id not in self._by_id and item_id.endswith(REPEAT_SUFFIX):
            original = self._by_id.get(item_id[: -len(REPEAT_SUFFIX)])
            if original is not None:
                self._by_id[item_id] = {**original, "id": item_id, "repeat_of": original["id"]}
        return self._by_id.get(item_id)

    # ---- internals ----------------------------------------------------------------------------------

    def _append(self, event: dict) -> None:
        with self.path.open("a") as f:  # one line per event, flushed at once: a crash loses nothing
            f.write(json.dumps(event, ensure_ascii=False) + "\n")

    def _labelled(self) -> set[str]:
        return {r["item_id"] for r in self._labels}

    def _show_next(self) -> None:
        self._show(self._next_item_id())

    def _show(self, item_id: str | None, rationale: str = "") -> None:
        labelled = self._labelled()
        agreement = preference_labels.self_agreement(self._labels)
        with self.hold_sync():  # the browser sees the new item in one message
            self.done = sum(1 for item in self.items if item["id"] in labelled)
            self.can_undo = bool(self._labels)
            self.self_agreement = (f"{agreement['agreed']} of {agreement['repeats']} repeats agreed"
                                   if agreement["repeats"] else "")
            self.finished = item_id is None
            if item_id is None:
                self.item_id = self.prompt = self.text_a = self.text_b = self.rationale = ""
                self.cut_a = self.cut_b = False
                return
            item = self._item(item_id)
            if item_id not in self._sides:  # the coin for this item, tossed once
                self._sides[item_id] = [1, 0] if self._rng.random() < 0.5 else [0, 1]
            left, right = self._sides[item_id]
            if item is None:
                raise KeyError(f"no item {item_id!r} to show")
            self.prompt = item["prompt"]
            self.text_a, self.text_b = item["completions"][left], item["completions"][right]
            self.cut_a, self.cut_b = item["truncated"][left], item["truncated"][right]
            self.rationale = rationale
            self.item_id = item_id  # last: the browser resets its timer on this change
            self._shown_at = time.monotonic()
