"""What connect() adds to the official tinker SDK's clients, all in this file.

Five additions: results remember the datums that made them (for the reprs), a custom loss's value reaches the
ledger, listeners on a training client's optim_step (for the probes), sampling constraints, and a warning when an
optim_step follows a forward_backward that failed (a loop that does not await its forward_backward otherwise steps on
no gradient without a word: a budget's 402 refused the pass, and the optim_step still "succeeds").

Each wrapper calls the SDK's own method and changes nothing it returns. `install()` is idempotent.
`sdk_method(cls, name)` is the SDK's own method under a wrapper, for calls a widget makes that should
not be remembered as the user's (a probe's forward must not be taken for the loop's by a repr).

How it works, and why: docs/workbench.md, "Inside the workbench, module by module", workbench/client/sdk_hooks.py.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import math
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

RECENT = 32  # calls remembered; a repr looks for its result's call among them

_lock = threading.Lock()
_recent: collections.deque = collections.deque(maxlen=RECENT)
_custom_losses: dict[str, list[tuple[float, float]]] = {}  # run id -> [(surrogate loss, the user's loss)]
# TrainingClient -> its optim_step listeners. Weak on the client, so a client that is gone leaves no entry;
# a listener holding its client (Probes does) keeps it until removed (Probes.close()).
_optim_listeners: "weakref.WeakKeyDictionary[object, list[Callable]]" = weakref.WeakKeyDictionary()
_constraint: contextvars.ContextVar = contextvars.ContextVar("stepwise_sample_constraint", default=None)
# TrainingClient -> the future of its newest forward_backward not yet followed by an optim_step.
_last_pass: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()


@dataclass
class Call:
    """One recorded SDK call: `kind` is "forward_backward" (forward too) or "sample"."""

    kind: str
    client: object
    data: list | None = None  # forward / forward_backward: the datums
    num_samples: int = 0      # sample

    def datums(self) -> list:
        """A forward / forward_backward call's datums (such a call always records them)."""
        if self.data is None:
            raise ValueError(f"this {self.kind} call recorded no datums")
        return self.data


def recent_calls(kind: str) -> list[Call]:
    """The remembered calls of one kind, newest first."""
    with _lock:
        return [call for call in reversed(_recent) if call.kind == kind]


def user_loss(training_run_id: str | None, loss: float) -> float:
    """The user's loss for a ledger loss that is a custom loss's surrogate (from this process), else `loss`
    (a row of no run is none of this process's custom losses)."""
    with _lock:
        pairs = list(_custom_losses.get(training_run_id, ())) if training_run_id is not None else []
    for surrogate, mine in reversed(pairs):
        if math.isclose(surrogate, loss, rel_tol=1e-5, abs_tol=1e-9):
            return mine
    return loss


def on_optim_step(training_client, callback: Callable[[object, object], None]) -> Callable[[], None]:
    """Call `callback(training_client, future)` right after each `training_client.optim_step(...)` call
    (on the caller's thread, once the step is submitted). Installs the hooks. Returns a function that
    removes the listener."""
    install()
    with _lock:
        _optim_listeners.setdefault(training_client, []).append(callback)

    def remove() -> None:
        with _lock:
            listeners = _optim_listeners.get(training_client, [])
            if callback in listeners:
                listeners.remove(callback)

    return remove


def sdk_method(cls, name: str):
    """The SDK's own `cls.name`, under the wrapper install() put there (the method itself when none)."""
    method = getattr(cls, name)
    return method.__wrapped__ if getattr(method, "_stepwise_wrapped", False) else method


def _remember(call: Call) -> None:
    with _lock:
        _recent.append(call)


# client -> the workbench Connection to its backend, or None: workbench.connect's, given to install() (this module
# imports nothing of the workbench's).
_connection_of = lambda client: None  # noqa: E731


def install(connection_of=None) -> None:
    """Wrap the SDK's methods (once); `connection_of(client)`, when given, finds a client's Connection (the ledger
    hears of custom losses through it)."""
    global _connection_of
    from tinker import SamplingClient, TrainingClient
    from tinker.resources.sampling import AsyncSamplingResource

    if connection_of is not None:
        _connection_of = connection_of

    for cls, name, wrapper in ((TrainingClient, "forward", _wrap_forward),
                               (TrainingClient, "forward_backward", _wrap_forward_backward),
                               (TrainingClient, "forward_backward_custom", _wrap_custom),
                               (TrainingClient, "optim_step", _wrap_optim_step),
                               (SamplingClient, "sample", _wrap_sample),
                               (AsyncSamplingResource, "asample", _wrap_asample)):
        method = getattr(cls, name)
        if not getattr(method, "_stepwise_wrapped", False):
            wrapped: Any = functools.wraps(method)(wrapper(method))  # Any: a function given an attribute of ours
            wrapped._stepwise_wrapped = True
            setattr(cls, name, wrapped)


def _wrap_forward(method):
    def forward(self, data, *args, **kwargs):
        _remember(Call("forward_backward", self, data=list(data)))
        return method(self, data, *args, **kwargs)

    return forward


def _wrap_forward_backward(method):
    forward = _wrap_forward(method)

    def forward_backward(self, data, *args, **kwargs):
        future = forward(self, data, *args, **kwargs)
        with _lock:
            _last_pass[self] = future
        return future

    return forward_backward


def _warn_if_it_failed(training_client, future) -> None:
    """Once the forward_backward `future` is done, warn if it failed: the optim_step sent after it had no gradient."""
    inner = future.future() if hasattr(future, "future") else future  # the SDK's APIFuture holds a concurrent one
    if not hasattr(inner, "add_done_callback"):
        return

    def check(done) -> None:
        error = None if done.cancelled() else done.exception()
        if error is not None:
            warnings.warn(
                f"an optim_step of {getattr(training_client, 'model_id', 'a training run')} followed a forward_backward "
                f"that failed, so it stepped on no gradient: {error}. Await each forward_backward (its .result()) "
                "before the optim_step to stop at the error.", RuntimeWarning, stacklevel=1)

    inner.add_done_callback(check)


def _wrap_sample(method):
    def sample(self, prompt, num_samples, *args, constraint: dict | None = None, **kwargs):
        _remember(Call("sample", self, num_samples=int(num_samples)))
        if constraint is None:
            return method(self, prompt, num_samples, *args, **kwargs)
        token = _constraint.set(constraint)  # the SDK's task copies this context when sample() schedules it
        try:
            return method(self, prompt, num_samples, *args, **kwargs)
        finally:
            _constraint.reset(token)

    return sample


def _wrap_asample(method):
    async def asample(self, *, request, **kwargs):
        constraint = _constraint.get()
        if constraint is not None:
            request = _constrained_request(request, constraint)
        return await method(self, request=request, **kwargs)

    return asample


@functools.cache
def _constrained_request_type() -> type:
    from tinker import types

    class ConstrainedSampleRequest(types.SampleRequest):
        """The SDK's SampleRequest with our `constraint` (dumped with it: the body is the request's own dump)."""

        constraint: dict

    return ConstrainedSampleRequest


def _constrained_request(request, constraint: dict):
    return _constrained_request_type()(**dict(request), constraint=constraint)


def _wrap_optim_step(method):
    def optim_step(self, *args, **kwargs):
        with _lock:
            passed = _last_pass.pop(self, None)
        future = method(self, *args, **kwargs)
        if passed is not None:
            _warn_if_it_failed(self, passed)
        with _lock:
            listeners = list(_optim_listeners.get(self, ()))
        for callback in listeners:
            try:
                callback(self, future)
            except Exception as error:  # noqa: BLE001 - a widget's trouble must not stop the training loop
                warnings.warn(f"an optim_step listener failed: {error!r}", RuntimeWarning, stacklevel=2)
        return future

    return optim_step


def _wrap_custom(method):
    def forward_backward_custom(self, data, loss_fn, *args, **kwargs):
        _remember(Call("forward_backward", self, data=list(data)))
        future = method(self, data, loss_fn, *args, **kwargs)
        with _lock:
            _last_pass[self] = future
        inner = future.future() if hasattr(future, "future") else None
        if inner is not None:
            inner.add_done_callback(lambda done: _report_custom_loss(self, done))
        return future

    return forward_backward_custom


def _report_custom_loss(training_client, done) -> None:
    """Tell the ledger what the user's loss was for the surrogate forward_backward it recorded."""
    if done.cancelled() or done.exception() is not None:
        return
    metrics = dict(done.result().metrics)
    if "surrogate_loss:sum" not in metrics:
        return  # a loss the server ran itself (a LossHandle with a loss_id): the ledger has it
    with _lock:
        _custom_losses.setdefault(training_client.model_id, []).append(
            (float(metrics["surrogate_loss:sum"]), float(metrics["loss:sum"])))
    conn = _connection_of(training_client)
    if conn is None:
        return
    try:
        conn.http.post("/api/v1/usage/custom_loss", timeout=10, json={
            "training_run_id": training_client.model_id, "surrogate_loss": metrics["surrogate_loss:sum"],
            "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}})
    except Exception:  # noqa: BLE001 - a display nicety; training goes on without it
        pass
