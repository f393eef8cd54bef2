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

import torch

SMALL_WORK = 1 << 23  # multiply-adds: ~8.4 M, the break-even measured on a 2-core Zen 4 (a 2-core AVX-512 Intel agrees)


class small:
    """Run the block on one thread if `work` multiply-adds are below SMALL_WORK: `with small(work): ...`.

    A class rather than a @contextlib.contextmanager generator: a decode step enters it ~480 times (each base
    product, LoRA pair, MLP activation and attention at 32 rows with LoRA), and the generator's machinery cost
    ~4.6 us a use against ~2.3 here (measured on a loaded 2-core Xeon, 2026-12-05): ~1 ms a step."""

    __slots__ = ("work", "threads")

    def __init__(self, work: int) -> None:
        self.work = work

    def __enter__(self) -> None:
        threads = torch.get_num_threads()
        self.threads = threads if self.work < SMALL_WORK and threads != 1 else 0  # 0: nothing to give back
        if self.threads:
            torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
