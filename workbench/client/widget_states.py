"""The kernel's answers to a page asking for every widget (a notebook opened or reloaded), made safe
while other threads create and close widgets.

`install()` replaces ipywidgets' and ipykernel's handlers of that request with ones that read a copy of their
registries, so a widget made or closed on another thread meanwhile no longer costs the page every widget.

How it works, and why: docs/workbench.md, "Inside the workbench, module by module", workbench/client/widget_states.py.
"""

from __future__ import annotations

import logging
from typing import Any

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
        except Exception as error:  # noqa: BLE001 - being built or closed by another thread; see docs/workbench.md
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
    kernel: Any = getattr(get_ipython(), "kernel", None)  # ipykernel's Kernel (or None), whose attributes IPython types loosely
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
