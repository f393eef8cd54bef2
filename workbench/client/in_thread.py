"""Long work awaited in a notebook cell, so the notebook stays live while it runs.

    summary = await workbench.in_thread(rl.run, config, service_client=client, on_step=...)

A plain `rl.run(...)` blocks the kernel's main thread for the whole run, and the kernel answers its widgets'
requests on that thread: a page reloaded (or a notebook reopened) while it trains shows "Loading widget..."
and then "Error displaying widget: model not found" until the cell ends, minutes later. Awaited instead, the
work runs on a worker thread and the cell waits on the kernel's event loop, where ipykernel (7.4 and later)
serves widget (comm) messages while a cell awaits: the widgets come back within seconds (tests/test_notebooks.py
reopens notebook 02 in a second tab mid-run; tests/test_workbench.py asks a kernel for its widgets mid-cell). Output, progress bars and plots still go to the cell (the worker runs in the
cell's context), and other cells still wait their turn.

The worker makes widgets off the kernel's shell thread (a recipe's progress bar, the dashboard's plots), so
in_thread first makes the kernel's answer to a reloaded page safe from that (workbench/client/widget_states.py).

Kernel > Interrupt stops the work too: while the cell awaits, SIGINT raises KeyboardInterrupt in the worker (at
its next line of Python: after the request it is waiting on returns), not in the kernel's event loop, and the cell
raises `Interrupted` once the work has stopped.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import functools
import signal
import threading
from typing import Any, Callable, TypeVar

from workbench.client import widget_states

T = TypeVar("T")


class Interrupted(Exception):
    """The work was stopped by Kernel > Interrupt (raised in the cell as KeyboardInterrupt's stand-in: a
    KeyboardInterrupt raised inside the kernel's event loop would stop the loop itself)."""


async def in_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a worker thread, awaited (see the module docstring): its result, or its exception."""
    widget_states.install()  # the worker's widgets vs. a page reloaded meanwhile
    loop = asyncio.get_running_loop()
    running: dict[str, int] = {}  # "thread": the worker's id while fn runs (a pool thread: never interrupt it after)

    def call():
        running["thread"] = threading.get_ident()
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted(f"{getattr(fn, '__qualname__', fn)} was stopped by Kernel > Interrupt") from None
        finally:
            running.pop("thread", None)

    def interrupt(*_):  # SIGINT (Kernel > Interrupt), on the main thread: stop the worker, not the event loop
        thread = running.get("thread")
        if thread is not None:
            _raise_in(thread, KeyboardInterrupt)

    context = contextvars.copy_context()  # the cell's output goes where the cell's does
    future = loop.run_in_executor(None, functools.partial(context.run, call))
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupt) if main else None
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:  # cancelled all the same (a kernel's own SIGINT handling): stop the worker too
        interrupt()
        try:
            await future  # the cell ends when the work has stopped
        except Exception as stopped:
            raise stopped from None
        raise
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def _raise_in(thread_id: int, exception: type[BaseException]) -> None:
    """Raise `exception` in another thread at its next Python bytecode (CPython's PyThreadState_SetAsyncExc)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exception))
