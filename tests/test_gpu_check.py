"""bench/gpu_check.sh, the script a session with a lent GPU runs once, in its smoke mode on CPU.

GPU time is scarce (a session that has a device gets minutes of it): the script must not be the
thing that fails there. Its smoke mode runs every step on a tiny random model on CPU: building a
model from a config, loading it through the engine (as an operator-registered base model),
measuring the matmul peak, LoRA training with MFU, and the sampler against `generate`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from servers import REPO


def test_gpu_check_runs_every_step_in_smoke_mode():
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--smoke"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert re.search(r"1\. measured bf16 matmul peak: [\d.]+ TFLOP/s", out), out[-3000:]
    assert re.search(r"2\. LoRA training .*: [\d,]+ tokens/s, .* MFU [\d.]+% of the measured peak", out), out[-3000:]
    ratio = re.search(r"3\. sampling, batch 64 .* ratio ([\d.]+)", out)
    assert ratio and float(ratio[1]) > 0, out[-3000:]
