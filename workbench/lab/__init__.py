"""The JupyterLab side of Stepwise: a jupyter_server extension and the prebuilt labextension it ships.

The labextension (TypeScript source in extension/, built into workbench/lab/labextension/ and
installed by the wheel under share/jupyter/labextensions/stepwise-lab) draws the sessions sidebar and
the status-bar cost meter. It never talks to a backend itself: it polls `GET /stepwise/sessions` on
the Jupyter server (handlers.py), which finds the backends that notebook kernels connected to
(backends.py) and reads their usage API with their keys. So the browser never holds a backend key,
and the meter keeps updating while a kernel is busy running a cell.

The wheel's etc/jupyter/jupyter_server_config.d/stepwise.json enables this server extension.
"""

from __future__ import annotations


def _jupyter_server_extension_points():
    return [{"module": "workbench.lab"}]


def _jupyter_labextension_paths():
    # For `jupyter labextension develop`; an installed wheel carries the files as shared data.
    return [{"src": "labextension", "dest": "stepwise-lab"}]


def _load_jupyter_server_extension(server_app):
    from workbench.lab.handlers import setup_handlers

    setup_handlers(server_app.web_app)
    server_app.log.info("Stepwise: serving /stepwise/sessions for the sessions sidebar and cost meter")
