"""Preference judgments as data: what each choice means, how sure it is, and the files they travel in.

A judgment is one label record of the Labeler (workbench/widgets/labeler.py). Its `choice` is one of

    A, A_slightly, tie, B_slightly, B, both_bad, skip      (a verdict on the pair shown)
    edit                                                   (the person rewrote one answer)

How it works, and why: docs/workbench.md, "Inside the workbench, module by module",
workbench/recipes/preference_labels.py.
"""

from __future__ import annotations

import json
from pathlib import Path

# choice -> (which side won, strength); None: no verdict on which answer is better
VERDICTS = {
    "A": ("A", "clear"), "A_slightly": ("A", "slight"),
    "B": ("B", "clear"), "B_slightly": ("B", "slight"),
    "tie": (None, None), "both_bad": (None, None), "skip": (None, None),
    "edit": (None, "clear"),
}
CHOICES = tuple(VERDICTS)
CONFIDENCE = {"clear": 1.0, "slight": 0.75}
REPEAT_SUFFIX = "~repeat"  # the id of a hidden repeat: the first showing's id + this


def is_training_pair(record: dict) -> bool:
    """A record that says which answer is better (A/B of any strength, or an edit), and is not a
    hidden repeat (a repeat measures the person; its pair already trained the first time)."""
    return (record.get("type", "label") == "label" and record.get("chosen") is not None
            and record.get("rejected") is not None and not record.get("repeat_of"))


def confidence(record: dict) -> float:
    """The probability the label gives to chosen beating rejected (docs/workbench.md, "Inside the workbench")."""
    return CONFIDENCE.get(record.get("strength") or "clear", 1.0)


def verdict(record: dict) -> str | None:
    """What a label says about the pair, independent of which side each answer was shown on:
    "0" or "1" (that completion of the item won), "tie", "both_bad"; None for skip and edit."""
    choice = record.get("choice")
    if record.get("preferred") is not None and choice in VERDICTS and VERDICTS[choice][0] is not None:
        return str(record["preferred"])
    return choice if choice in ("tie", "both_bad") else None


def self_agreement(records: list[dict]) -> dict:
    """How often a hidden repeat got the same verdict as its first showing (strength aside).

    Returns {"repeats": n, "agreed": k, "rate": k / n or None}; a repeat whose first label was undone,
    or either of which was a skip or an edit, does not count."""
    first = {r["item_id"]: verdict(r) for r in records if not r.get("repeat_of")}
    pairs = [(first.get(r["repeat_of"]), verdict(r)) for r in records if r.get("repeat_of")]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    agreed = sum(a == b for a, b in pairs)
    return {"repeats": len(pairs), "agreed": agreed, "rate": agreed / len(pairs) if pairs else None}


# ---- files --------------------------------------------------------------------------------------------

EXTRA_KEYS = ("id", "choice", "strength", "confidence", "policy_version", "rating", "rationale", "labeler", "time")


def to_row(record: dict) -> dict:
    """One label record as a row of the common preference format (+ our own keys)."""
    row = {"prompt": record["prompt"], "chosen": record["chosen"], "rejected": record["rejected"]}
    extra = {"id": record.get("item_id"), "confidence": confidence(record), **record}
    row.update({k: extra[k] for k in EXTRA_KEYS if extra.get(k) not in (None, "")})
    return row


def export_jsonl(records: list[dict], path: str | Path) -> int:
    """Write every training pair among `records` as prompt/chosen/rejected JSONL; returns how many."""
    rows = [to_row(r) for r in records if is_training_pair(r)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)


def _text(value, role: str) -> str:
    """A field of the format as text: a string, or a chat message list (the last `role` turn's content)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], dict):
        turns = [m for m in value if m.get("role") == role] or value
        return str(turns[-1].get("content", ""))
    raise ValueError(f"expected a string or a list of chat messages, not {type(value).__name__}")


def import_jsonl(path: str | Path) -> list[dict]:
    """Read a prompt/chosen/rejected JSONL (ours, TRL's, a Hugging Face preference dataset's) as
    records: {prompt, chosen, rejected, strength, ...}, ready for a Labeler's `heldout=` or for
    workbench.recipes.dpo. A line without the three keys is an error that names its line."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [k for k in ("chosen", "rejected") if k not in row]
        if missing or ("prompt" not in row and not isinstance(row.get("chosen"), list)):
            raise ValueError(f"{path}:{number}: a preference row needs prompt, chosen and rejected "
                             f"(missing {', '.join(missing) or 'prompt'})")
        prompt = row.get("prompt")
        if prompt is None:  # conversational rows may carry the prompt inside chosen
            prompt = row["chosen"][:-1]
        strength = row.get("strength") if row.get("strength") in CONFIDENCE else "clear"
        records.append({**{k: row[k] for k in EXTRA_KEYS if k in row}, "type": "label", "choice": row.get("choice", "A"),
                        "item_id": str(row.get("id") or f"imported-{number}"), "strength": strength,
                        "prompt": _text(prompt, "user"), "chosen": _text(row["chosen"], "assistant"),
                        "rejected": _text(row["rejected"], "assistant")})
    return records
