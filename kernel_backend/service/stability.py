"""Stability info for stable_reinforce: what the sampler records, and the provenance that reads it back.

Recording. A sample request with `record_stability_info` keeps, per returned sequence id, the request's
prompt, the sampled tokens and the sampler's logprob of each token: the "information captured at sampling
time" that stable_reinforce's importance weight needs (kernel_backend/engine/losses.py). Rows are in the store
(StabilityRow), so a restart keeps them; they belong to the session that sampled them and expire a day
after sampling, each training request that uses one restarting its day (Tinker's documented lifetime);
an ended session's rows go at once (nothing can train on them any more).

Bounded. A session holds at most `settings.max_stability_tokens` recorded tokens (prompt + sampled, per
sequence). A request is counted when it is admitted, at its most (every sample at max_tokens), against
what is recorded plus what requests still in flight reserved; its reservation ends when it finishes.

Reading. `resolve` checks a stable_reinforce batch's provenance against the recorded sequences (each run
names a sequence of the caller's session, lies within it and repeats its tokens; the runs tile the input
and the targets; advantages are zero off the sampled tokens) and gives each datum the loss's inputs:
`logprobs`, the sampler's recorded logprob on sampled targets (0 elsewhere), and `sampled_mask`. A client's
own `logprobs` are replaced: the recorded ones are what the sampler computed. Bad provenance is a UserError
naming the run, before anything is queued.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading

import numpy as np

from kernel_backend.persistence.database import StabilityRow, now
from kernel_backend.types import Datum, SampleResult, Span
from kernel_backend.errors import UserError

KEEP = dt.timedelta(days=1)


class Recorder:
    """The per-session cap on recorded tokens, with the reservations of sample requests in flight."""

    def __init__(self, settings, store) -> None:
        self.settings, self.store = settings, store
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[str, int]] = {}  # request id -> (session id, tokens reserved)

    def admit(self, session_id: str, request_id: str, tokens: int) -> None:
        """Reserve `tokens` of the session's cap for a sample request, or raise naming the cap."""
        cap = self.settings.max_stability_tokens
        with self._lock:
            held = self.store.stability_tokens(session_id)
            held += sum(n for session, n in self._pending.values() if session == session_id)
            if held + tokens > cap:
                raise UserError(
                    f"recording stability info for this request could take {tokens} tokens, and session {session_id} "
                    f"already holds {held} of its {cap} (STEPWISE_MAX_STABILITY_TOKENS, prompt + sampled tokens per "
                    "sequence); recorded sequences are kept a day after their last use, or until the session ends: "
                    "sample with fewer samples or a smaller max_tokens, or without record_stability_info"
                )
            self._pending[request_id] = (session_id, tokens)

    def settle(self, request_id: str) -> None:
        """A request finished (recorded or failed): its reservation ends."""
        with self._lock:
            self._pending.pop(request_id, None)


def most_tokens(prompt_tokens: int, num_samples: int, max_tokens: int) -> int:
    """The most a sample request can record: each sequence keeps the prompt and up to max_tokens tokens."""
    return num_samples * (prompt_tokens + max_tokens)


def record(store, tenant: str, session_id: str, sequence_ids: list[str], prompt: list[int],
           result: SampleResult) -> None:
    """Keep each sampled sequence's tokens and sampler logprobs under its sequence id."""
    packed_prompt = np.asarray(prompt, dtype="<i4").tobytes()
    until = now() + KEEP
    store.add(*[
        StabilityRow(sequence_id=sid, tenant=tenant, session_id=session_id, prompt=packed_prompt,
                     tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
                     logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
                     size=len(prompt) + len(seq.tokens), expires_at=until)
        for sid, seq in zip(sequence_ids, result.sequences)
    ])


def resolve(store, tenant: str, session_id: str, data: list[Datum]) -> list[Datum]:
    """The batch with stable_reinforce's inputs filled from its provenance; UserError on bad provenance."""
    ids = {span.sequence_id for d in data for span in (d.model_input_spans or []) + (d.loss_fn_input_spans or [])}
    rows = store.stability_rows(ids) if ids else {}
    for sid in sorted(ids):
        row = rows.get(sid)
        if row is None or row.tenant != tenant:
            raise UserError(
                f"sequence {sid!r} has no recorded stability info: stable_reinforce trains only on sequences sampled "
                "with record_stability_info=True, within a day of their sampling or last use")
        if row.session_id != session_id:
            raise UserError(f"sequence {sid!r} was sampled in another session; provenance works only within one "
                            "session: sample and train in the same session")
    out = [_resolve_datum(d, f"data[{i}]", rows) for i, d in enumerate(data)]
    store.keep_stability(ids, now() + KEEP)  # a use restarts the day
    return out


def _resolve_datum(datum: Datum, where: str, rows: dict[str, StabilityRow]) -> Datum:
    if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
        raise UserError(f"{where} has no provenance, which stable_reinforce needs: sample with "
                        "record_stability_info=True and attach Datum.with_provenance(model_input=..., loss_fn_inputs=...)")
    targets = np.asarray(datum.loss_fn_inputs.get("target_tokens", []))
    if targets.ndim != 1:
        raise UserError(f"{where}.loss_fn_inputs['target_tokens'] must be 1-D for stable_reinforce (one sampled "
                        f"token per position), got shape {targets.shape}")
    _check_runs(datum.model_input_spans, datum.tokens, f"{where}.model_input_spans", rows)
    _check_runs(datum.loss_fn_input_spans, targets.tolist(), f"{where}.loss_fn_input_spans", rows)

    sampler_logprobs = np.zeros(len(targets), dtype=np.float32)
    sampled = np.zeros(len(targets), dtype=np.float32)
    position = 0
    for span in datum.loss_fn_input_spans:
        if span.sampled:
            recorded = np.frombuffer(rows[span.sequence_id].logprobs, dtype="<f4")
            sampler_logprobs[position:position + span.length] = recorded[span.offset:span.offset + span.length]
            sampled[position:position + span.length] = 1.0
        position += span.length
    advantages = datum.loss_fn_inputs.get("advantages")
    if advantages is not None and np.shape(advantages) == targets.shape:
        off = np.flatnonzero((np.asarray(advantages) != 0) & (sampled == 0))
        if off.size:
            raise UserError(f"{where}.loss_fn_inputs['advantages'] is nonzero at position {int(off[0])}, which its "
                            "provenance says is a prompt token; stable_reinforce trains sampled tokens only: give "
                            "prompt positions advantage 0")
    inputs = {**datum.loss_fn_inputs, "logprobs": sampler_logprobs, "sampled_mask": sampled}
    return dataclasses.replace(datum, loss_fn_inputs=inputs)


def _check_runs(spans: list[Span], tokens: list[int], where: str, rows: dict[str, StabilityRow]) -> None:
    """The runs tile `tokens`, each within its sequence's prompt or sampled tokens, and repeat them."""
    covered = sum(span.length for span in spans)
    if covered != len(tokens):
        raise UserError(f"{where} cover {covered} positions but the field has {len(tokens)}; the runs must tile it "
                        "exactly (Datum.with_provenance checks this on the client)")
    position = 0
    for j, span in enumerate(spans):
        row = rows[span.sequence_id]
        kind, stored = ("sampled tokens", row.tokens) if span.sampled else ("prompt", row.prompt)
        source = np.frombuffer(stored, dtype="<i4")
        if span.offset + span.length > len(source):
            raise UserError(f"{where}[{j}] names positions {span.offset}..{span.offset + span.length - 1} of sequence "
                            f"{span.sequence_id!r}'s {kind}, which has {len(source)} tokens")
        if tokens[position:position + span.length] != source[span.offset:span.offset + span.length].tolist():
            raise UserError(f"{where}[{j}] says positions {position}..{position + span.length - 1} are sequence "
                            f"{span.sequence_id!r}'s {kind} from {span.offset}, but the tokens differ")
        position += span.length
