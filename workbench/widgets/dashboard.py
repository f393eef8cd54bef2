"""The training dashboard: loss per step from the usage ledger, locally logged metrics, tokens, cost.

    dash = workbench.Dashboard(training_run_id=tc.model_id)   # or session=service_client
    display(dash)
    for step in range(n):
        fb = tc.forward_backward(batch, "cross_entropy"); tc.optim_step(adam).result()
        dash.log(step, reward=mean_reward, kl=kl)              # anything computed in the notebook

Loss comes from the backend: every ForwardBackward row of the usage API's series carries
metrics["loss:sum"] and the run's optimizer `step`. Rows are read incrementally (the API's cursor)
by refresh(), which a background poller calls every `poll_interval` seconds, so the plot moves
while the training cell is still running. Several ForwardBackward rows at one step (gradient
accumulation) are summed, as losses are sums over tokens.

State is plain traitlets (loss_steps, loss_values, metrics, cost, tokens), so tests read it
without a browser; redraws are throttled (a few per second) because plotly re-sends whole traces.
"""

from __future__ import annotations

import html
import threading

import ipywidgets as w
import plotly.graph_objects as go
import traitlets as t

from workbench.widgets.cost import run_id_of, session_id_of
from workbench.widgets.polling import Poller
from workbench.widgets.throttle import Throttle

LOSS_TYPE = "ForwardBackward"
PAGE = 1000


def _figure(title: str, y_title: str) -> go.FigureWidget:
    fig = go.FigureWidget(layout=go.Layout(
        title=title, height=280, margin=dict(l=50, r=10, t=40, b=40),
        xaxis_title="step", yaxis_title=y_title, legend=dict(orientation="h", y=-0.25),
    ))
    return fig


class Dashboard(w.VBox):
    training_run_id = t.Unicode(None, allow_none=True)
    session_id = t.Unicode(None, allow_none=True)
    # Loss points in arrival order; loss_runs says which training run each belongs to.
    loss_steps = t.List()
    loss_values = t.List()
    loss_runs = t.List()
    metrics = t.Dict()  # name -> {"steps": [...], "values": [...]} from log()
    cost = t.Float(0.0)
    tokens = t.Dict()  # prefill / sample / train token totals
    requests = t.Int(0)
    cursor = t.Int(0)
    error = t.Unicode("")

    def __init__(self, training_run_id=None, session=None, *, connection=None, poll_interval: float | None = 1.0,
                 redraw_interval: float = 0.3):
        from workbench.connect import current

        self.connection = connection or current()
        run_id, session_id = run_id_of(training_run_id), session_id_of(session)
        if run_id is None and session_id is None:
            raise ValueError("Dashboard needs training_run_id= (an id or a TrainingClient) or session=")
        self.loss_fig = _figure("loss per step (sum over tokens)", "loss")
        self.metrics_fig = _figure("logged metrics", "value")
        self.stats = w.HTML()
        super().__init__([w.HBox([self.loss_fig, self.metrics_fig]), self.stats])
        self.training_run_id, self.session_id = run_id, session_id
        self._losses: dict[tuple[str, int], float] = {}  # (run, step) -> summed loss, insertion-ordered
        self._lock = threading.Lock()  # refresh() runs on the poller thread and on demand
        self._draw_lock = threading.Lock()  # so do redraws (the throttle's timer and the caller)
        self._redraw = Throttle(self._draw, redraw_interval)
        self._poller = Poller(self.refresh, poll_interval or 0, on_error=self._show_error)
        self.refresh()
        if poll_interval:
            self._poller.start()

    # ---- data in -------------------------------------------------------------------------------------

    def refresh(self) -> int:
        """Pull the usage rows that arrived since the last call; returns how many were new."""
        with self._lock:
            rows = self._pull()
        self._redraw()
        return rows

    def _pull(self) -> int:
        new = 0
        while True:  # the API pages at PAGE rows; a long run read for the first time takes several
            report = self.connection.usage(training_run_id=self.training_run_id, session_id=self.session_id,
                                           after=self.cursor, limit=PAGE)
            rows = report["series"]
            for row in rows:
                loss = (row.get("metrics") or {}).get("loss:sum")
                if row["request_type"] == LOSS_TYPE and loss is not None and row.get("step") is not None:
                    key = (row["training_run_id"], int(row["step"]))
                    self._losses[key] = self._losses.get(key, 0.0) + float(loss)
            totals = report["totals"]
            with self.hold_trait_notifications():
                if rows:
                    self.loss_runs = [run for run, _ in self._losses]
                    self.loss_steps = [step for _, step in self._losses]
                    self.loss_values = list(self._losses.values())
                self.cursor = report["cursor"]
                self.cost = totals["cost"]
                self.requests = totals["requests"]
                self.tokens = {k: totals[f"{k}_tokens"] for k in ("prefill", "sample", "train")}
                self.error = ""
            new += len(rows)
            if len(rows) < PAGE:
                return new

    def log(self, step: int, **values: float) -> None:
        """Record metrics computed in the notebook (reward=..., kl=...) at `step`."""
        metrics = {name: {"steps": list(m["steps"]), "values": list(m["values"])} for name, m in self.metrics.items()}
        for name, value in values.items():
            series = metrics.setdefault(name, {"steps": [], "values": []})
            series["steps"].append(int(step))
            series["values"].append(float(value))
        self.metrics = metrics  # a new dict, so traitlets observers see the change
        self._redraw()

    # ---- drawing -------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Redraw now (the throttle may be holding back the latest points)."""
        self._redraw.flush()

    def _draw(self) -> None:
        with self._draw_lock:
            self._draw_now()

    def _draw_now(self) -> None:
        by_run: dict[str, tuple[list, list]] = {}
        for run, step, value in zip(self.loss_runs, self.loss_steps, self.loss_values):
            xs, ys = by_run.setdefault(run, ([], []))
            xs.append(step)
            ys.append(value)
        _set_traces(self.loss_fig, {run or "loss": xy for run, xy in by_run.items()})
        _set_traces(self.metrics_fig, {name: (m["steps"], m["values"]) for name, m in self.metrics.items()})
        tok = self.tokens
        error = f" · <span style='color:#b00'>{html.escape(self.error)}</span>" if self.error else ""
        self.stats.value = (
            f"<span style='font:12px sans-serif'>tokens: prefill {tok.get('prefill', 0):,} · "
            f"sample {tok.get('sample', 0):,} · train {tok.get('train', 0):,} · {self.requests} requests · "
            f"<b>cost ${self.cost:.6f}</b>{error}</span>"
        )

    def _show_error(self, error: Exception) -> None:
        self.error = str(error)
        self._redraw()

    # ---- lifetime ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Poll the usage API in the background (started by the constructor when poll_interval is set)."""
        self._poller.start()

    def stop(self) -> None:
        self._poller.stop()

    def close(self) -> None:
        self.stop()
        for child in (self.loss_fig, self.metrics_fig, self.stats):
            child.close()
        super().close()


def _set_traces(fig: go.FigureWidget, series: dict[str, tuple[list, list]]) -> None:
    """Make `fig` show exactly `series` (name -> (x, y)), in one message to the browser."""
    with fig.batch_update():
        existing = {trace.name: trace for trace in fig.data}
        for name, (xs, ys) in series.items():
            if name in existing:
                existing[name].x, existing[name].y = xs, ys
            else:
                fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=name)
