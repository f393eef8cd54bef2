"""Small tensor products run on the calling thread alone.

The backend sets OMP_WAIT_POLICY=PASSIVE (kernel_backend/__main__.py), so that idle OpenMP
workers sleep instead of spinning: on a busy shared machine spinning workers slow everything
down 5-10x (docs/performance.md). The price is paid per parallel op: waking the sleeping workers
costs 50-100 us, more than a small matrix product takes on one core. A decode step is mostly
such products (its rows are few: 8 x 576 by 576 x 32 for one adapter's LoRA, 32 x 576 by 576 x
192 for a key projection), hundreds of them per step, and with the wake-ups it took twice as long.

`small(work)` runs a block on one thread when `work` (its multiply-adds) is below SMALL_WORK,
where one core is measured as fast as two (bench: docs/performance.md, "Small products").
Larger work (a training batch, the vocabulary-wide unembedding) keeps every thread.

torch.set_num_threads sets OpenMP's and MKL's per-thread counts: it changes only the calling
thread (the scheduler's), and is restored on the way out.
"""

from __future__ import annotations

import contextlib

import torch

SMALL_WORK = 1 << 23  # multiply-adds: ~8.4 M, the break-even measured on a 2-core Zen 4 (a 2-core AVX-512 Intel agrees)


@contextlib.contextmanager
def small(work: int):
    """Run the block on one thread if `work` multiply-adds are below SMALL_WORK."""
    threads = torch.get_num_threads()
    if work >= SMALL_WORK or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
