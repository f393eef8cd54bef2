"""The session's training runs as a tree: each fork under the run it branched from, at its fork step.

    runs = workbench.Runs(session=client, dashboard=dashboard)   # dashboard=: its logged metrics per run too
    runs                                                         # a table, refreshed every few seconds

A run forked with workbench.fork (or made from a checkpoint of another run) has a `parent_run_id`
and a `fork_step` (the backend's fields, kernel_backend/service/checkpoints.py's lineage); that is the tree. Each line
shows the run's name (user_metadata "name", else its number), where it branched off, the steps it
covers (a fork's start at its fork step: the steps of its parent's x axis), its last loss, the latest
value of each metric a Dashboard logged for it, and its cost (its own training work). The loss is a
sum over the step's tokens (Tinker's losses are sums), unlike a per-token eval_loss; a note under the
table says what the session spent beyond its runs' training (sampling, logprobs), so the rows need
not add up to the session's cost.

Everything comes from the usage API's session report (GET /api/v1/usage/sessions, the sidebar's
source) and each run's kept steps (GET /api/v1/training_runs/{id}/steps, whose newest is the step
the run is at, after an undo too). State is plain traitlets: `runs`, one dict per run in tree order
({training_run_id, name, parent_run_id, fork_step, depth, first_step, step, last_loss, cost,
metrics}), and `error`.
"""

from __future__ import annotations

import html

import ipywidgets as w
import traitlets as t

from workbench.widgets.cost import format_cost, session_id_of
from workbench.widgets.polling import Poller

SESSIONS_LISTED = 1000  # the report's largest page: the session is among the tenant's newest


def tree_order(runs: list[dict]) -> list[dict]:
    """Runs parent first, each one's forks after it (in the order they were made), with their depth. A run whose
    parent is not in the list (another session's) is a root."""
    ids = {r["training_run_id"] for r in runs}
    children: dict[str | None, list[dict]] = {}
    for run in runs:
        parent = run.get("parent_run_id")
        children.setdefault(parent if parent in ids else None, []).append(run)
    ordered: list[dict] = []

    def visit(run: dict, depth: int) -> None:
        ordered.append({**run, "depth": depth})
        for child in children.get(run["training_run_id"], []):
            visit(child, depth + 1)

    for root in children.get(None, []):
        visit(root, 0)
    return ordered


class Runs(w.VBox):
    runs: t.List[dict] = t.List()
    error = t.Unicode("")

    def __init__(self, session, *, dashboard=None, connection=None, poll_interval: float | None = 3.0):
        from workbench.client.connect import current

        self.connection = connection or current()
        self.session_id = session_id_of(session)
        self.session_cost: float | None = None  # the whole session's, from the usage API
        if self.session_id is None:
            raise ValueError("Runs needs session= (a ServiceClient that has made a training client, or a session id)")
        self.dashboard = dashboard
        self.table = w.HTML()
        super().__init__([self.table])
        self.add_class("wb-runs")
        self._poller = Poller(self.refresh, poll_interval or 0, on_error=self._show_error)
        self.refresh()
        if poll_interval:
            self._poller.start()

    def refresh(self) -> None:
        http = self.connection.http
        report = http.get("/api/v1/usage/sessions", params={"limit": SESSIONS_LISTED})
        report.raise_for_status()
        session = next((s for s in report.json()["sessions"] if s["session_id"] == self.session_id), None)
        self.session_cost = float(session["cost"]) if session else None
        runs = []
        for run in (session or {}).get("runs", []):
            # Its kept steps, and its lineage (service/past_steps.py).
            listing = http.get(f"/api/v1/training_runs/{run['training_run_id']}/steps")
            listing.raise_for_status()
            steps = listing.json()
            memory = [s["step"] for s in steps["steps"] if s["where"] == "memory"]
            first = steps["fork_step"] or 0
            runs.append({
                "training_run_id": run["training_run_id"], "name": run_label(run["training_run_id"], run.get("user_metadata")),
                "parent_run_id": steps["parent_run_id"], "fork_step": steps["fork_step"],
                "first_step": first, "step": max(memory) if memory else first + run["steps"],
                "last_loss": run["last_loss"], "cost": run.get("cost", 0.0), "metrics": self._metrics_of(run["training_run_id"]),
            })
        with self.hold_trait_notifications():
            self.runs = tree_order(runs)
            self.error = ""
        self.table.value = self._html()

    def _metrics_of(self, run_id: str) -> dict[str, float]:
        """The latest value of each metric the dashboard logged for this run."""
        latest = {}
        for name in (self.dashboard.metrics if self.dashboard is not None else {}):
            points = self.dashboard.points(name, run_id)
            if points:
                latest[name] = max(points)[1]
        return latest

    def _html(self) -> str:
        if not self.runs:
            return "<div class='wb-runs-empty' style='font:12px sans-serif;color:#666'>No training runs in this session yet.</div>"
        names = {r["training_run_id"]: r["name"] for r in self.runs}
        metrics = list(dict.fromkeys(name for r in self.runs for name in r["metrics"]))
        columns = [("run", ""), ("branched from", ""), ("steps", ""),
                   ("last loss (sum)", "the last forward_backward's loss: a sum over its tokens, not a mean"),
                   *((m, "the latest value the dashboard logged") for m in metrics),
                   ("cost", "the run's own training work (forward_backward, optim_step)")]
        head = "".join(f"<th title='{html.escape(why, quote=True)}'>{html.escape(name)}</th>" for name, why in columns)
        rows = []
        for r in self.runs:
            branch = ""
            if r["parent_run_id"]:
                parent = names.get(r["parent_run_id"], r["parent_run_id"])
                branch = f"{html.escape(parent)} @ step {r['fork_step']}"
            loss = "" if r["last_loss"] is None else f"{r['last_loss']:.4g}"
            values = "".join(f"<td>{r['metrics'][m]:.4g}</td>" if m in r["metrics"] else "<td></td>" for m in metrics)
            rows.append(
                f"<tr class='wb-run' data-run='{html.escape(r['training_run_id'], quote=True)}' data-depth='{r['depth']}'"
                f" data-parent='{html.escape(r['parent_run_id'] or '', quote=True)}'>"
                f"<td style='padding-left:{6 + 18 * r['depth']}px'>{'└ ' if r['depth'] else ''}"
                f"<b class='wb-run-name'>{html.escape(r['name'])}</b></td><td class='wb-run-branch'>{branch}</td>"
                f"<td>{r['first_step']}–{r['step']}</td><td>{loss}</td>{values}<td>{format_cost(r['cost'])}</td></tr>")
        return ("<table class='wb-runs-table' style='border-collapse:collapse;font:12px sans-serif'>"
                "<style>.wb-runs-table td,.wb-runs-table th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left}</style>"
                f"<tr>{head}</tr>{''.join(rows)}</table>{self._note()}")

    def _note(self) -> str:
        """What the session spent beyond its runs' own training: the rows' costs do not add up to it."""
        if self.session_cost is None:
            return ""
        own = sum(r["cost"] for r in self.runs)
        rest = max(0.0, self.session_cost - own)
        return (f"<div class='wb-runs-note' style='font:11px sans-serif;color:#666;padding:4px 8px'>The session spent "
                f"{format_cost(self.session_cost)}: {format_cost(own)} on these runs' training, {format_cost(rest)} on "
                "the rest (sampling, and logprobs of its samplers and base model).</div>")

    def _show_error(self, error: Exception) -> None:
        self.error = str(error)
        self.table.value = self._html() + f"<div style='color:#b00;font:12px sans-serif'>{html.escape(self.error)}</div>"

    def stop(self) -> None:
        self._poller.stop()

    def close(self) -> None:
        self.stop()
        self.table.close()
        super().close()


def run_label(run_id: str, user_metadata: dict | None) -> str:
    """What a run is called in the workbench: its user_metadata "name", else "run <n>" (its number in its session)."""
    return (user_metadata or {}).get("name") or f"run {run_id.rsplit(':', 1)[-1]}"
