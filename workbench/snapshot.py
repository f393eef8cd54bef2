"""Undo a step: snapshot a training run, try something, and go back.

    snap = workbench.snapshot(tc)            # save_state under a generated name
    tc.optim_step(...)                       # try a step, look at samples...
    tc = workbench.restore(snap)             # ...and roll back

Semantics. restore() does not rewind `tc` in place: it creates a NEW training run (a new
`model_id`, a new TrainingClient) from the saved weights and optimizer state
(create_training_client_from_state_with_optimizer), so its next optim_step is exactly the step
the snapshotted run would have taken. The old client and run stay as they are (usable, and their
usage rows and checkpoints remain); rebind your variable to the returned client. A dashboard
following the old run keeps following the old run.
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass, field


@dataclass
class Snapshot:
    path: str  # tinker://<run>/weights/<name>
    training_run_id: str
    name: str
    created: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat())
    service_client: object = field(default=None, repr=False, compare=False)

    def _repr_html_(self) -> str:
        return f"<code>Snapshot {self.name}</code> of run <code>{self.training_run_id}</code> ({self.created})"


def snapshot(training_client, name: str | None = None, *, service_client=None) -> Snapshot:
    """Save the run's weights and optimizer state now; returns a handle for restore().

    The save is queued after the requests already submitted on this client, so it captures the
    state after them.
    """
    name = name or f"snapshot-{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    path = training_client.save_state(name).result().path
    return Snapshot(path=path, training_run_id=training_client.model_id, name=name, service_client=service_client)


def restore(handle: Snapshot | str, *, service_client=None):
    """A new TrainingClient with the snapshot's weights and optimizer state (see the module doc)."""
    path = handle.path if isinstance(handle, Snapshot) else str(handle)
    if service_client is None and isinstance(handle, Snapshot):
        service_client = handle.service_client
    if service_client is None:
        from workbench.connect import current

        service_client = current().service_client
    return service_client.create_training_client_from_state_with_optimizer(path).result()
