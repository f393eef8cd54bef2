"""Go back to any step of a training run: fork a new run from it, sample at it, or undo steps in place.

    run2 = workbench.fork(tc, step=3, name="lr 3e-4")   # a new run, starting from tc's state after step 3
    s16 = workbench.sampler_at(tc, step=16)             # a SamplingClient of tc's weights after step 16
    workbench.undo(tc)                                  # tc itself goes back one step
    workbench.kept_steps(tc)                            # the steps it can go back to

Steps count optimizer steps: step k is the state after the k-th optim_step (step 0: as created).
The backend keeps each run's state after its last STEPWISE_STEP_HISTORY steps (default 8) and its
start in memory, and on disk every STEPWISE_SNAPSHOT_EVERY-th step (default 10, the newest
STEPWISE_SNAPSHOTS_KEPT = 8 of them), for as long as the run's session lives
(kernel_backend/engine/step_history.py); `save_state` what you want to keep for longer.

A fork is a run of its own (its own id, ledger rows, name in the sidebar) made the Tinker way:
a checkpoint of the parent's state after step k (our one route of its own, for a step already past:
kernel_backend/service/past_steps.py), then `create_training_client_from_state_with_optimizer(path)`,
which records the new run's `parent_run_id` and `fork_step` (fields of the backend's own: its
user_metadata stays what you gave; `workbench.lineage(run)` reads them). Its adapter and
optimizer state are bit for bit the parent's after step k, so the same step k+1 on both gives the
same weights; its steps count on from k, so its curves start at step k on the parent's x axis.
The parent is not touched.

`undo` rewinds the run itself (`load_state_with_optimizer`, the run keeps its id): what the loop
does next is as if the undone steps never happened, though their ledger rows (their cost) stay.
"""

from __future__ import annotations

import secrets
import warnings

from workbench.client.connect import current
from workbench.client.connection import BackendError, Connection


def kept_steps(training_client, *, connection: Connection | None = None) -> list[int]:
    """The steps of the run whose state it can go back to now (memory and disk together)."""
    listing = (connection or current()).run_steps(training_client.model_id)
    return [s["step"] for s in listing["steps"]]


def current_step(training_client, *, connection: Connection | None = None) -> int:
    """The optim steps the run has taken (its newest kept step: the engine keeps the one it is at)."""
    steps = kept_steps(training_client, connection=connection)
    if not steps:
        raise BackendError(f"the backend does not know which step run {training_client.model_id} is at yet (it "
                           "restarted since its last step): take a step, or name the step you want")
    return max(steps)


def fork(training_client, step: int | None = None, name: str | None = None, *, user_metadata: dict | None = None,
         connection: Connection | None = None):
    """A new TrainingClient whose adapter and optimizer state are `training_client`'s after `step` (default: now),
    in the same session; `name` names it in the dashboards, the Runs tree and the sidebar."""
    connection = connection or current()
    if step is None:  # now: a save in the run's own request order, after whatever the loop has sent
        path = training_client.save_state(f"fork-{secrets.token_hex(4)}").result().path
    else:
        path = connection.checkpoint_step(training_client.model_id, step, "training")
    metadata = {**(user_metadata or {}), **({"name": name} if name else {})}
    service = _service_of(training_client, connection)
    return service.create_training_client_from_state_with_optimizer(path, user_metadata=metadata or None).result()


def sampler_at(training_client, step: int, *, connection: Connection | None = None):
    """A SamplingClient of the run's weights after `step`, without a training client of that step."""
    connection = connection or current()
    path = connection.checkpoint_step(training_client.model_id, step, "sampler")
    return _service_of(training_client, connection).create_sampling_client(model_path=path).result()


def undo(training_client, steps: int = 1, *, connection: Connection | None = None) -> int:
    """Take the run back `steps` optim steps, in place (same run, same client); returns the step it is at now.
    Call it after the steps' results are in (it goes back from the newest step the backend has finished)."""
    connection = connection or current()
    target = current_step(training_client, connection=connection) - steps
    if target < 0:
        raise ValueError(f"run {training_client.model_id} has taken fewer than {steps} steps; nothing to undo")
    path = connection.checkpoint_step(training_client.model_id, target, "training")
    # The SDK deprecates loading into an existing run (Tinker moves to a new client per checkpoint); this backend
    # keeps it, and an undo that keeps the run and the client is the point, so the warning is not for the user.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DEPRECATED: TrainingClient.load_state", FutureWarning)
        training_client.load_state_with_optimizer(path).result()
    return target


def lineage(training_run_id: str, *, connection: Connection | None = None) -> dict:
    """The run's parent and fork step ({"parent_run_id": None, ...} for a run made from scratch)."""
    listing = (connection or current()).run_steps(training_run_id)
    return {"parent_run_id": listing["parent_run_id"], "fork_step": listing["fork_step"]}


def _service_of(training_client, connection: Connection):
    """The ServiceClient that made `training_client` (a fork belongs to the same session), else the newest one."""
    for client in connection.clients:
        if getattr(client, "_session_holder", None) is training_client.holder:
            return client
    if connection.service_client is None:
        raise BackendError("no ServiceClient from workbench.connect() in this kernel; call workbench.connect() first")
    return connection.service_client
