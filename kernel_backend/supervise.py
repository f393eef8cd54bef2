"""Keep a backend up: `serve --supervise` runs `serve` as a child and starts it again when it dies.

workbench.connect() starts the embedded backend this way. A backend that the OOM killer or a `kill -9`
took down comes back by itself on the same port, with the same key (the child's arguments and
environment are the same every time), rebuilds the runs it had (service/recovery.py), and the
notebook's next call, which the SDK retries while the backend is away, just works.

Not restarted: a child that exited as asked (exit code 0: `--exit-when-unused` found nobody using it;
143: it was sent SIGTERM, by the supervisor or by a process that stopped it), one that exited with an
error within its first STARTUP_S seconds (a start that fails, say on a missing model, would only fail
again; a child killed by a signal is restarted however soon), or one that died MAX_RESTARTS times within
WINDOW_S seconds.
SIGTERM and SIGINT to the supervisor go to the child, and the supervisor exits with it.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections import deque

log = logging.getLogger("stepwise.supervise")

STARTUP_S = 10.0
MAX_RESTARTS, WINDOW_S = 5, 600.0


def supervise(serve_args: list[str]) -> int:
    """Run `python -m kernel_backend serve *serve_args` until it ends for good; returns its exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stopping = False
    child: subprocess.Popen | None = None

    def forward(signum, frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    deaths: deque[float] = deque()
    while True:
        started = time.monotonic()
        child = subprocess.Popen([sys.executable, "-m", "kernel_backend", "serve", *serve_args])
        code = child.wait()
        lived = time.monotonic() - started
        if stopping or code in (0, 128 + signal.SIGTERM):  # it ended as asked (serve exits 143 on SIGTERM)
            return code
        if code > 0 and lived < STARTUP_S:  # it failed on start (a signal is never that: a kill is restarted)
            log.error("the backend failed %.0f s after it started (exit %s): not restarting it", lived, code)
            return code
        deaths.append(time.monotonic())
        while deaths and deaths[0] < time.monotonic() - WINDOW_S:
            deaths.popleft()
        if len(deaths) > MAX_RESTARTS:
            log.error("the backend died %d times in %.0f s: not restarting it again", len(deaths), WINDOW_S)
            return code
        log.warning("the backend died (exit %s) after %.0f s; starting it again", code, lived)
