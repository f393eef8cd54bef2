"""What every script in bench/ sets up first, before it imports torch (`import benchenv` at its top):

- OMP_WAIT_POLICY=PASSIVE, as the server and the tests set it: idle OpenMP threads sleep instead of spinning, so a
  benchmark and the backends it starts suffer a busy machine alike (libgomp reads it once, at load);
- the checkout and its tests/ folder on sys.path (the backend, the workbench, and the tests' helpers such as
  servers.start_server), so that `python bench/<script>.py` runs from a clone without an install of its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parent.parent
for path in (REPO / "tests", REPO):  # the checkout first
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model


def load_line() -> str:
    """The machine's load, printed beside a benchmark's figures (they mean little on a busy machine)."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus"
