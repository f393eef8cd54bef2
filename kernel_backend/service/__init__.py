"""The training-session service: what each API call does, independent of HTTP.

Routers in `kernel_backend.api` parse requests into the SDK's own pydantic types, call one function
of the concern module that owns the call, and turn the answer into a response. Direct answers are
plain dicts; queued work returns a `FutureRow` whose result the client polls with retrieve_future.

    core.py         `Service`, what the others share: the store, checkpoint storage, the executor,
                    admission, futures (submit, on_done, retrieve), housekeeping (reap, end_session)
                    and the tenant-checked lookups (session, run, live_run, checkpoint, sampler)
    sessions.py     create / heartbeat / finish / get / list / search sessions; their projects; traces
    training.py     training runs: create_model, get_info, forward_backward, optim_step; run listings
    checkpoints.py  save_state, save_weights_for_sampler, save_weights_external, load_state; checkpoint
                    listings, TTL, delete
    publishing.py   who else may read a checkpoint: publish / unpublish, copy_weights into a project
    downloads.py    signed download URLs: external weights' files, session traces
    sampling.py     sampling sessions and sample; `generate` for the OpenAI-compatible endpoint
    stability.py    stable_reinforce's stability info: recorded at sampling (capped per session), read
                    back through a training Datum's provenance
    accounts.py     the ledger and the audit log: usage and per-session reports, billing, storage usage,
                    the audit log; the auth JWTs (whoami)

Each concern module is plain functions that take the `Service` first: `training.optim_step(svc, ...)`.
"""

from kernel_backend.service.core import Service

__all__ = ["Service"]
