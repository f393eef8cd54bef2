"""Poller: call a widget's refresh() every few seconds on a daemon thread, until stopped.

Why a thread: while a training cell runs, the kernel executes nothing else, but a thread can still
read the usage API and push widget updates to the browser (Python -> browser messages flow while a
cell runs). Errors are handed to `on_error` and polling continues, slower, so a backend restart
does not kill the widget. A backend that went away (its notebooks' kernels shut down, or it was
killed) is handed over as `BackendStopped`, whose message says so in words, not as the socket's
"[Errno 111] Connection refused".
"""

from __future__ import annotations

import threading
from typing import Callable

import httpx


class BackendStopped(ConnectionError):
    """The widget's backend does not answer at its address: what the widget shows, and what to do."""


def explain(error: Exception) -> Exception:
    """`error` as a person should read it: a refused or broken connection means the backend stopped."""
    if isinstance(error, httpx.TimeoutException):
        return BackendStopped("Backend not answering (no reply within the timeout; busy or hung): "
                              "the figures shown are the last ones read")
    if isinstance(error, (httpx.TransportError, OSError)):  # refused, reset, closed socket (errno 9, 111)
        return BackendStopped("Backend stopped: the figures shown are the last ones read. "
                              "Run workbench.connect() to start it again; this widget picks up where it left off")
    return error


class Poller:
    def __init__(self, fn: Callable[[], object], interval: float, on_error: Callable[[Exception], None] | None = None):
        self.fn = fn
        self.interval = interval
        self.on_error = on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="workbench-poller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def _run(self) -> None:
        delay = self.interval
        while not self._stop.wait(delay):
            try:
                self.fn()
                delay = self.interval
            except Exception as error:  # keep polling: the backend may come back
                delay = min(delay * 2, 30.0)
                if self.on_error is not None:
                    self.on_error(explain(error))
