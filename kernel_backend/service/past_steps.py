"""A run's past steps: which states after which optim steps can still be had, and a checkpoint of one.

A fork is plain Tinker: a checkpoint of the parent's state after step k, then
`create_training_client_from_state_with_optimizer(path)`, which records the lineage (the new run's
parent_run_id and fork_step fields: checkpoints.lineage). What Tinker has no call for is a checkpoint of a step that is already
past; that is this module, behind two REST routes (api/rest.py):

    GET  /api/v1/training_runs/{run}/steps                 what the run can go back to
    POST /api/v1/training_runs/{run}/steps/{k}/checkpoint  a checkpoint of the state after step k,
         {"kind": "training" | "sampler"}                  named step-00000k; answers a future to poll

Where a past step's state is (the policy, docs/workbench.md states it too): the engine keeps the last
STEPWISE_STEP_HISTORY steps of each run in memory, and its start (kernel_backend/engine/step_history.py); on disk
are the run's recovery snapshots, every STEPWISE_SNAPSHOT_EVERY steps, the newest STEPWISE_SNAPSHOTS_KEPT of
them (service/recovery.py). Both last as long as the run's session; a step checkpoint is a checkpoint
like any other (kept until deleted or its TTL).
"""

from __future__ import annotations

from kernel_backend.service import checkpoints, recovery
from kernel_backend.service.core import Service
from kernel_backend.persistence.database import FutureRow
from kernel_backend.errors import UserError


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def kept(svc: Service, tenant: str, model_id: str) -> dict:
    """The steps of a run whose state can be checkpointed now, and where each one is."""
    run = svc.run(tenant, model_id)
    memory = svc.kept_steps.get(model_id, [])
    disk = recovery.snapshot_steps(svc, model_id)
    return {
        "training_run_id": model_id,
        "steps": [{"step": s, "where": "memory" if s in memory else "disk"} for s in sorted({*memory, *disk})],
        **checkpoints.lineage(run),
    }


def save(svc: Service, tenant: str, model_id: str, step: int, kind: str) -> FutureRow:
    """Queue a checkpoint of the run's state after `step`: weights and optimizer ("training", for a fork) or
    the adapter alone ("sampler", to sample at that step)."""
    if kind not in ("training", "sampler"):
        raise UserError(f"kind must be 'training' (to fork) or 'sampler' (to sample), not {kind!r}")
    if not isinstance(step, int) or not 0 <= step < 2**31:
        raise UserError(f"step must be a whole number from 0 (an optim step the run took), got {step!r}")
    known = [s["step"] for s in kept(svc, tenant, model_id)["steps"]]
    # Refused now when this server knows the run's steps; after a restart, before the run's next step, it does
    # not, and the engine says whether it has the state (a failed future with the same advice).
    if model_id in svc.kept_steps and step not in known:
        raise UserError(f"the state after step {step} of {model_id} is not kept; it can go back to steps {known} "
                        "(the last STEPWISE_STEP_HISTORY steps in memory, every STEPWISE_SNAPSHOT_EVERY-th on disk): "
                        "save_state at the steps you will want to return to, or raise STEPWISE_STEP_HISTORY")
    return checkpoints.save_weights(svc, tenant, model_id, None, checkpoint_name(step), kind, step=step)
