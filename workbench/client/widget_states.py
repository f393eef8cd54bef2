"""The kernel's answers to a page asking for every widget (a notebook opened or reloaded), made safe
while other threads create and close widgets.

When JupyterLab opens or reloads a notebook, its widget manager opens ipywidgets' control comm and
sends `request_states`; the kernel answers with one `update_states` message holding the state of every
live widget, and the page builds its widget models from it. Without an answer within 4 s the page falls
back to a `comm_info_request` (the kernel's list of widget comms) and asks each of those for its state.
A view whose model came back in neither way shows "Error displaying widget: model not found"; one whose
answer never came stays at "Loading widget...".

Both answers are read on the kernel's shell thread by iterating a live registry: ipywidgets 8 (every
release through 8.1.9, the newest when this was written) iterates its dict of live widgets
(`ipywidgets.widgets.widget._instances`), reading each widget's state as it goes, and ipykernel (6 and
7, through 7.4) its comm manager's dict of comms. The workbench creates and closes widgets on other
threads: a run awaited with workbench.in_thread draws its progress bars and the dashboard's plots on a
worker thread, and the dashboard's and the cost meter's pollers and redraw timers run on threads of
their own. A widget created or closed by one of them during that loop makes it raise ("RuntimeError:
dictionary changed size during iteration"; or an AttributeError from a widget closed after the loop
reached it, whose `model_id` reads its comm, now None). The exception ends the handler before it sends
anything (ipykernel logs "Exception in message handler"), so the page gets no answer: intermittently,
depending on what another thread did at that moment, a reloaded page shows "model not found" or never
finishes loading its widgets (seen in a browser with a thread making progress bars in the kernel,
tests/test_notebooks.py).

install() (called when workbench.widgets is imported and when workbench.in_thread starts work, the
two ways our widgets get made off the shell thread) replaces both handlers with ones that read a copy
of the registry, taken in one step. The widget states skip a widget closed meanwhile (its views are gone
from the page too) or one that fails to give its state (read mid-construction by another thread: its
comm_open message, sent when it registered, carries its state to the page anyway), so one bad widget no
longer costs the page all the others. It patches ipywidgets 8.x (7.x has no control comm; a later major
version is left alone) and ipykernel 6.x and 7.x, once per process, and only handlers those packages
defined themselves: should a release fix them, the replies ours send are the same as theirs.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

MODEL_PREFIX = "IPY_MODEL_"  # how one widget's state refers to another (ipywidgets' widget_serialization)

_ORIGINAL: dict = {}  # "handler": ipywidgets' own classmethod, once install() has replaced it (tests compare both)


def install() -> bool:
    """Answer `request_states` with safe_states(), and a running kernel's `comm_info_request` from a copy
    of its comms, from now on; True if ipywidgets' handler is (now) the safe one, False where it needs
    no patch (ipywidgets missing, or not an 8.x release)."""
    _install_comm_info()
    try:
        import ipywidgets
        from ipywidgets.widgets import widget as widget_module
    except ImportError:  # no notebook here (`stepwise serve`, scripts): nothing answers a page
        return False
    if "handler" in _ORIGINAL:
        return True
    if not ipywidgets.__version__.startswith("8."):
        return False
    handler = widget_module.Widget.__dict__["_handle_control_comm_msg"]
    if getattr(handler, "__func__", None) is None or handler.__func__.__module__ != widget_module.__name__:
        return False  # someone else's handler: leave it
    _ORIGINAL["handler"] = handler
    # Looked up by name each time the page opens the control comm (Widget.handle_control_comm_opened),
    # so a page (re)loaded after this gets the safe handler.
    widget_module.Widget._handle_control_comm_msg = classmethod(_handle_control_comm_msg)
    return True


def _handle_control_comm_msg(cls, msg: dict) -> None:
    """ipywidgets' handler, but `request_states` is answered by safe_states()."""
    if cls._control_comm is None:
        raise RuntimeError("Control comm has not been properly opened")
    if msg["content"]["data"]["method"] != "request_states":
        return _ORIGINAL["handler"].__func__(cls, msg)  # ipywidgets' own error for any other method
    from ipywidgets.widgets.widget import _remove_buffers

    states, buffer_paths, buffers = _remove_buffers(safe_states())
    cls._control_comm.send({"method": "update_states", "states": states, "buffer_paths": buffer_paths},
                           buffers=buffers)


def safe_states() -> dict[str, dict]:
    """Every live widget's state as `update_states` carries it ({model_id: {model_name, model_module,
    model_module_version, state}}), read while other threads may create and close widgets."""
    from ipywidgets.widgets import widget as widget_module

    # dict.copy() copies in one step under the GIL (no Python code runs in between), so no other thread
    # adds or removes an entry halfway; iterating the registry itself is what fails.
    registry = widget_module._instances.copy()
    states = {}
    for model_id, widget in registry.items():
        try:
            entry = {"model_name": widget._model_name, "model_module": widget._model_module,
                     "model_module_version": widget._model_module_version,
                     "state": widget.get_state(drop_defaults=False)}
        except Exception as error:  # noqa: BLE001 - being built or closed by another thread; see the module doc
            log.debug("widget %s skipped in the page's request for widget states: %r", model_id, error)
            continue
        if widget.comm is None:  # closed while its state was read: the page drops its views anyway
            continue
        states[model_id] = entry
    return _self_contained(states)


def _self_contained(states: dict[str, dict]) -> dict[str, dict]:
    """The states less any that refer to a widget not among them (a box whose child another thread closed
    while the states were read): the page builds every model of the answer together, and one whose child it
    cannot find fails them all ("model not found" for widgets that were never in doubt). Dropped until none
    is left referring to a missing one (a box inside a dropped box goes too)."""
    def references(value) -> set[str]:
        if isinstance(value, str):
            return {value[len(MODEL_PREFIX):]} if value.startswith(MODEL_PREFIX) else set()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, (list, tuple)):
            return set().union(*map(references, value))
        return set()

    needs = {model_id: references(entry["state"]) for model_id, entry in states.items()}
    kept = set(states)
    while True:
        broken = {model_id for model_id in kept if not needs[model_id] <= kept}
        if not broken:
            return {model_id: states[model_id] for model_id in kept}
        log.debug("widgets %s left out of the page's widget states: they refer to widgets closed meanwhile", broken)
        kept -= broken


def _install_comm_info() -> None:
    """The running kernel's `comm_info_request` answered from a copy of its comms (ipykernel 6, 7)."""
    try:
        import ipykernel
        from IPython import get_ipython
    except ImportError:
        return
    kernel = getattr(get_ipython(), "kernel", None)
    handlers = getattr(kernel, "shell_handlers", None)
    if not ipykernel.__version__.startswith(("6.", "7.")) or not isinstance(handlers, dict):
        return  # not in an ipykernel kernel, or one this was not written against
    handler = handlers.get("comm_info_request")
    if getattr(handler, "__func__", None) is not type(kernel).comm_info_request:
        return  # already ours, or someone else's
    # The kernel binds its handlers when it starts (Kernel.__init__), so the table is patched, not the class.

    async def comm_info_request(stream, ident, parent):
        if not kernel.session:
            return
        target_name = parent["content"].get("target_name", None)
        registry = kernel.comm_manager.comms.copy() if hasattr(kernel, "comm_manager") else {}  # in one step
        comms = {comm_id: {"target_name": comm.target_name} for comm_id, comm in registry.items()
                 if target_name is None or comm.target_name == target_name}
        kernel.session.send(stream, "comm_info_reply", {"comms": comms, "status": "ok"}, parent, ident)

    handlers["comm_info_request"] = comm_info_request
