"""The kernel's answer to a page asking for every widget's state, made safe while other threads create
and close widgets.

When JupyterLab opens or reloads a notebook, its widget manager opens ipywidgets' control comm and
sends `request_states`; the kernel answers with one `update_states` message holding the state of every
live widget, and the page builds its widget models from it. A view whose model is not in that answer
shows "Error displaying widget: model not found".

ipywidgets 8 (every release through 8.1.9, the newest when this was written) answers on the kernel's
shell thread by iterating its registry of live widgets (`ipywidgets.widgets.widget._instances`, a dict)
directly, reading each widget's state as it goes. The workbench creates and closes widgets on other
threads: a run awaited with workbench.in_thread draws its progress bars and the dashboard's plots on a
worker thread, and the dashboard's and the cost meter's pollers and redraw timers run on threads of
their own. A widget created or closed by one of them during that loop makes it raise ("RuntimeError:
dictionary changed size during iteration"; or an AttributeError from a widget closed after the loop
reached it, whose `model_id` reads its comm, now None). The exception ends the handler before it
sends anything: ipykernel logs it and the page gets no answer. After 4 s the page falls back to
asking for each widget separately, and that path too can come back short on a busy kernel (its
comm_info list is read the same way); a page that then calls itself restored shows "model not found"
for the widgets it missed, intermittently, depending on what another thread did at that moment.

install() (called when workbench.widgets is imported and when workbench.in_thread starts work, the
two ways our widgets get made off the shell thread) replaces that handler with one that reads a copy
of the registry, taken in one step, and skips a widget closed meanwhile (its views are gone from the
page too) or one that fails to give its state (read mid-construction by another thread: its comm_open
message, sent when it registered, carries its state to the page anyway). Every other widget's state is
sent, so one bad widget no longer costs the page all the others. It patches ipywidgets 8.x only (7.x has
no control comm; a later major version is left alone), once per process, and only the handler
ipywidgets itself defined: should an 8.x release fix it, the reply ours sends is the same as theirs.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_ORIGINAL: dict = {}  # "handler": ipywidgets' own classmethod, once install() has replaced it (tests compare both)


def install() -> bool:
    """Answer `request_states` with safe_states() from now on; True if this call or an earlier one
    patched ipywidgets, False where it needs no patch (ipywidgets missing, or not an 8.x release)."""
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
    return states
