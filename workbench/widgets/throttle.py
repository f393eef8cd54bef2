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
    def __init__(self, fn: Callable[[], None], interval: float = 0.3, clock: Callable[[], float] = time.monotonic,
                 timer: Callable = threading.Timer):
        """`clock` and `timer` (threading.Timer's signature) are seams for tests: they move a fake clock and fire
        the trailing call themselves, so what they check does not depend on how fast the machine is."""
        self.fn = fn
        self.interval = interval
        self._clock, self._make_timer = clock, timer
        self._last = 0.0
        self._timer: threading.Timer | None = None  # (a test's timer stands in with Timer's interface)
        # Bumped whenever the pending trailing call is run or cancelled: a timer that fired while flush() held the
        # lock (too late for cancel()) finds it moved on and does nothing, rather than running fn a second time.
        self._generation = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            wait = self._last + self.interval - self._clock()
            if wait > 0:
                if self._timer is None:  # one trailing call covers every call in the window
                    self._timer = self._make_timer(wait, self._trailing, args=(self._generation,))
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._settle()  # a trailing call whose timer is late (a busy machine) is covered by this one
        self.fn()

    def flush(self) -> None:
        """Run now, cancelling any pending trailing call."""
        with self._lock:
            self._settle()
        self.fn()

    def _trailing(self, generation: int) -> None:
        with self._lock:
            if generation != self._generation:  # flushed since this timer was set
                return
            self._settle()
        self.fn()

    def _settle(self) -> None:
        """The pending trailing call, if any, is being run now: cancel its timer, start a new window. Lock held."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._generation += 1
        self._last = self._clock()
