"""The server extension's HTTP surface: one authenticated route the JupyterLab frontend polls.

    GET /stepwise/sessions?limit=50&active_only=false
        -> the merged report of every running backend, and what this lab spent since the server
           started (workbench/lab/backends.py)

It runs in the Jupyter server, not in a kernel, so it answers while a kernel is busy training, and
it holds the backends' keys so the browser never sees one. Jupyter's own login guards it: a call
without the server's token or cookie gets 403.

It also knows what a kernel cannot: which notebook each kernel runs *now*. A session is named after
its notebook when the kernel connects ($JPY_SESSION_NAME); after a rename only the Jupyter server's
sessions (kernel -> path) have the new path, so each report carries it, found by the kernel's pid.
"""

from __future__ import annotations

import json

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from workbench.lab.backends import LabMemory, find_backends, read_report

MAX_LIMIT = 1000  # the usage API's own bound


class SessionsHandler(APIHandler):
    @tornado.web.authenticated
    async def get(self):
        try:
            limit = int(self.get_argument("limit", "50"))
            if not 1 <= limit <= MAX_LIMIT:
                raise ValueError
        except ValueError:
            raise tornado.web.HTTPError(400, reason=f"limit must be an integer from 1 to {MAX_LIMIT}")
        active_only = self.get_argument("active_only", "false").lower() in ("1", "true", "yes")
        report = await read_report(find_backends(), limit=limit, active_only=active_only,
                                   lab=self.settings["stepwise_lab_memory"], notebooks=await self.notebooks())
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(report))

    async def notebooks(self) -> dict[int, str]:
        """The pid of each kernel this server runs -> the path of its notebook now."""
        paths = {}
        for model in await self.session_manager.list_sessions():
            kernel_id = (model.get("kernel") or {}).get("id")
            if kernel_id is None:
                continue  # no kernel (yet, or any longer): no process to name
            try:
                provisioner = self.kernel_manager.get_kernel(kernel_id).provisioner
            except (KeyError, tornado.web.HTTPError):
                # Shut down between the two calls: jupyter_server's kernel manager answers an unknown id with an
                # HTTPError(404), jupyter_client's with a KeyError. Either way one kernel fewer, not a failed report.
                continue
            pid = getattr(provisioner, "pid", None)  # a local kernel's process; remote provisioners have none
            if isinstance(pid, int):
                paths[pid] = model["path"]
        return paths


def setup_handlers(web_app) -> None:
    web_app.settings["stepwise_lab_memory"] = LabMemory()  # the sessions this server's lab has seen, from now
    base_url = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [(url_path_join(base_url, "stepwise", "sessions"), SessionsHandler)])
