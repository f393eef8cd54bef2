"""Throttle: run a redraw at most a few times per second, and never drop the last one.

Plot updates re-send whole arrays to the browser (plotly.py has no extendTraces), so a training
loop that logs every step would flood the comm channel. The throttle runs the first call at once,
coalesces calls that arrive within `interval` into one trailing call, and `flush()` runs a
pending call now (tests, and the end of a cell).
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Throttle:
    def __init__(self, fn: Callable[[], None], interval: float = 0.3):
        self.fn = fn
        self.interval = interval
        self._last = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            wait = self._last + self.interval - time.monotonic()
            if wait > 0:
                if self._timer is None:  # one trailing call covers every call in the window
                    self._timer = threading.Timer(wait, self.flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._last = time.monotonic()
        self.fn()

    def flush(self) -> None:
        """Run now, cancelling any pending trailing call."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._last = time.monotonic()
        self.fn()
