"""The training dashboard: loss per step from the usage ledger, metrics logged in the notebook,
tokens and cost.

    dash = workbench.Dashboard(session=service_client)          # or training_run_id=tc
    display(dash)
    for step in range(1, n + 1):
        fb = tc.forward_backward(batch, "cross_entropy"); tc.optim_step(adam).result()
        dash.log(step, reward=mean_reward, kl=kl)                # anything computed in the notebook

How it works, and why: docs/workbench.md, "Inside the workbench, module by module", workbench/widgets/dashboard.py.
"""

from __future__ import annotations

import copy
import html
import math
import textwrap
import threading
from typing import TYPE_CHECKING

import ipywidgets as w
import plotly.graph_objects as go
import traitlets as t

from workbench.client import sdk_hooks
from workbench.client.connection import combined_refusals, refusal_text
from workbench.widgets.cost import format_cost, run_id_of, session_id_of
from workbench.widgets.polling import Poller
from workbench.widgets.runs import run_label
from workbench.widgets.throttle import Throttle

if TYPE_CHECKING:
    from workbench.widgets.plot_clicks import PlotClicks

LOSS_TYPE = "ForwardBackward"
LOSS_PANEL = "loss per step (loss:sum, summed over tokens)"
PAGE = 1000
PANEL_WIDTH, PANEL_HEIGHT = 440, 250
LEGEND_ROW_PX = 20
TITLE_ROW_PX = 24  # the toolbar's row at the top, above the title's
HOVER_LINE_CHARS = 48  # a flag's detail, wrapped: a wide hover label is cut at the panel's edge


def _figure(title: str, y_title: str, series: dict[str, tuple[list, list]],
            skipped: dict[str, list[int]] | None = None, flags: list[dict] | None = None,
            x_of=None) -> go.Figure:
    """One panel: a line per series, broken at skipped steps, a row of marks per skip reason along
    the bottom, and one of red marks per kind of flag along the top.

    `x_of(trace, step)`: where a point of `trace` (None: a mark) at `step` sits on the x axis, its
    run's cumulative cost (None while the ledger has not priced that step yet: the point waits); no
    `x_of`, the x axis is the step. Every point carries its step as customdata, which the hover
    shows and a click reports (plot_clicks.js), whatever the x axis."""
    skipped, flags = skipped or {}, flags or []
    marked = sorted(s for steps in skipped.values() for s in steps)
    last = max([max(xs) for xs, _ in series.values() if xs] + marked, default=1)
    place = x_of or (lambda trace, step: step)

    def placed(trace: str | None, steps: list, values: list) -> tuple[list, list, list]:
        """(x, y, step) of the points that have a place on the x axis."""
        points = [(place(trace, s), v, s) for s, v in zip(steps, values)]
        kept = [p for p in points if p[0] is not None]
        return [x for x, _, _ in kept], [v for _, v, _ in kept], [s for _, _, s in kept]

    at_step = "step %{customdata}" + (" · $%{x}" if x_of else "")
    data = []
    for name, (steps, values) in series.items():
        xs, ys, at = placed(name, *_broken_at(steps, values, marked))
        data.append(go.Scatter(x=xs, y=ys, customdata=at, mode="lines+markers", name=name,
                               hovertemplate=f"{at_step}<br>%{{y}}"))
    # The marks sit on a hidden second y axis spanning [0, 1], so they stay along the bottom
    # whatever the panel's values, and the panel's own y range is set by its data alone.
    for why, steps in skipped.items():
        xs, ys, at = placed(None, steps, [0.04] * len(steps))
        data.append(go.Scatter(x=xs, y=ys, customdata=at, yaxis="y2", mode="markers", name=f"skipped ({why})",
                               marker=dict(symbol="x-thin-open", size=10, color="#888", line=dict(width=2)),
                               hovertemplate=f"{at_step}: skipped ({why})<extra></extra>"))
    # Flags sit in a strip of their own above the plot (a third y axis), so they never hide a line at its top.
    for kind in dict.fromkeys(f["kind"] for f in flags):
        mine = [f for f in flags if f["kind"] == kind and place(None, f["step"]) is not None]
        data.append(go.Scatter(x=[place(None, f["step"]) for f in mine], y=[0.5] * len(mine), yaxis="y3",
                               mode="markers", name=f"flag: {kind}",
                               text=["<br>".join(textwrap.wrap(f["detail"], HOVER_LINE_CHARS)) for f in mine],
                               customdata=[f["step"] for f in mine],
                               marker=dict(symbol="triangle-down", size=10, color="#d62728"),
                               hovertemplate=f"{at_step}: {kind}<br>%{{text}}<extra></extra>"))
    # Against cost: dollars to three significant digits, never SI prefixes (plotly's "5µ" is not money).
    xaxis = (dict(title=dict(text="$"), tickformat=".3~r", rangemode="tozero") if x_of
             else dict(title=dict(text="step"), dtick=_dtick(last)))
    # The legend below the axis, every entry shown: the panel grows a row at a time rather than clip it.
    legend_height = LEGEND_ROW_PX * _legend_rows([trace.name for trace in data]) if len(data) > 1 else 0
    return go.Figure(
        data=data,
        layout=go.Layout(
            # The title on a row of its own, just above the plot and below plotly's toolbar (the modebar, at the
            # figure's top right): centred at the top, a long title ran under the toolbar's icons (issue 56).
            title=dict(text=title, font=dict(size=14), yref="paper", y=1, yanchor="bottom", pad=dict(b=8)),
            width=PANEL_WIDTH, height=PANEL_HEIGHT + legend_height + TITLE_ROW_PX,
            margin=dict(l=60, r=15, t=34 + TITLE_ROW_PX, b=45 + legend_height), showlegend=len(data) > 1,
            legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0, xanchor="left", maxheight=1),
            xaxis=xaxis, hoverlabel=dict(align="left"),
            yaxis=dict(title=dict(text=y_title), domain=[0, 0.86] if flags else [0, 1]),
            yaxis2=dict(overlaying="y", range=[0, 1], visible=False, fixedrange=True),
            yaxis3=dict(domain=[0.9, 1], range=[0, 1], visible=False, fixedrange=True),
        ),
    )


def _legend_rows(names: list[str]) -> int:
    """How many rows plotly's horizontal legend takes for these entries in a panel: it lines them up in
    columns as wide as the widest (a symbol and a gap of about 40 px, then the name at about 7 px a
    character), as many as the panel's width holds."""
    widest = 40 + 7 * max(map(len, names), default=0)
    per_row = max(1, (PANEL_WIDTH - 20) // widest)
    return -(-len(names) // per_row)


def _broken_at(xs: list, ys: list, skipped: list[int]) -> tuple[list, list]:
    """The points with a None at each skipped step between two of them (plotly breaks the line
    there rather than drawing a straight line over a step that has no value)."""
    gaps = [s for s in skipped if xs and min(xs) < s < max(xs) and s not in xs]
    if not gaps:
        return xs, ys
    points = sorted([*zip(xs, ys), *((s, None) for s in gaps)], key=lambda p: p[0])
    return [x for x, _ in points], [y for _, y in points]


def _as_output(figure: go.Figure) -> dict:
    """The figure as one display_data output, drawn by JupyterLab's plotly renderer (jupyterlab-plotly)."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": {**figure.to_plotly_json(), "config": {"displaylogo": False}},
                     "text/plain": f"<plotly figure: {figure.layout.title.text}>"}}


def _smoothed(values: list, weight: float) -> list:
    """An exponential moving average (as TensorBoard's smoothing): each point is weight x the previous
    average + (1 - weight) x its value, debiased so the first points are not pulled towards 0."""
    out: list[float | None] = []
    average, count = 0.0, 0
    for value in values:
        if value is None:
            out.append(None)
            continue
        count += 1
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight ** count))
    return out


def _alerts(flags: list[dict], shown: int = 6) -> str:
    """The flagged steps in words: one line per stretch of consecutive steps flagged for the same trouble
    in the same run (a collapse lasts), with its newest evidence; the newest `shown` stretches."""
    stretches: list[dict] = []  # {"first", "last", "kind", "run", "detail"}
    for f in sorted(flags, key=lambda f: (f.get("run") or "", f["kind"], f["step"])):
        last = stretches[-1] if stretches else None
        if last and (last["run"], last["kind"]) == (f.get("run"), f["kind"]) and f["step"] == last["last"] + 1:
            last.update(last=f["step"], detail=f["detail"])
        else:
            stretches.append({"first": f["step"], "last": f["step"], "kind": f["kind"], "run": f.get("run"),
                              "detail": f["detail"]})
    stretches.sort(key=lambda s: s["last"])

    def line(s: dict) -> str:
        steps = f"step {s['first']}" if s["first"] == s["last"] else f"steps {s['first']}-{s['last']}"
        of_run = f" of {s['run']}" if s["run"] else ""
        return (f"<div class='wb-flag' data-step='{s['first']}' data-last-step='{s['last']}' "
                f"data-kind='{html.escape(s['kind'])}'>⚠ {steps}{html.escape(of_run)} · {html.escape(s['kind'])}: "
                f"{html.escape(s['detail'])}</div>")

    if not stretches:
        return ""
    more = f"<div>… and {len(stretches) - shown} earlier</div>" if len(stretches) > shown else ""
    lines = "".join(line(s) for s in stretches[-shown:])
    return f"<div class='wb-flags' style='font:12px sans-serif;color:#b42318'>{more}{lines}</div>"


def _dtick(last_step: int) -> int:
    """Whole steps on the x axis, at most about eight ticks."""
    return max(1, math.ceil(last_step / 8))


class Dashboard(w.VBox):
    training_run_id = t.Unicode(None, allow_none=True)  # the run, or the first of training_run_ids
    training_run_ids: t.List[str] = t.List()  # the runs given (training_run_id=[tc1, tc2] overlays them); [] in session scope
    session_id = t.Unicode(None, allow_none=True)
    # Loss points in arrival order; loss_runs says which training run each belongs to.
    loss_steps: t.List[int] = t.List()
    loss_values: t.List[float] = t.List()
    loss_runs: t.List[str | None] = t.List()
    metrics = t.Dict()  # name -> {"steps": [...], "values": [...], "runs": [...]} from log() (runs: ids or None)
    skipped = t.Dict()  # why -> the steps skipped for that reason, from skip()
    flags: t.List[dict] = t.List()  # [{"step", "kind", "detail"}] from flag(), in the order flagged
    # x="cost": run id -> {step: the run's cumulative cost when it finished that step}, from the ledger
    step_costs = t.Dict()
    cost = t.Float(0.0)
    tokens = t.Dict()  # prefill / sample / train token totals
    requests = t.Int(0)
    cursor = t.Int(0)  # the newest ledger row read (each scope keeps its own: _cursors)
    error = t.Unicode("")
    refusals = t.Dict()  # what the backend refused in the scope ({"count", "last"}, the usage API's; {} when none)
    children: tuple  # VBox's trait, declared for mypy: ipywidgets ships no types, and on_click sets it from itself

    def __init__(self, training_run_id=None, session=None, *, panels: dict[str, list[str]] | None = None,
                 labels: dict[str, str] | None = None, smoothing: float = 0.0, x: str = "step", connection=None,
                 poll_interval: float | None = 1.0, redraw_interval: float = 0.3):
        from workbench.client.connect import current

        if x not in ("step", "cost"):
            raise ValueError(f'x is "step" or "cost" (each metric against the run\'s cumulative cost), not {x!r}')
        self.x = x

        self.connection = connection or current()
        given = training_run_id if isinstance(training_run_id, (list, tuple)) else [training_run_id]
        run_ids, session_id = [r for r in map(run_id_of, given) if r is not None], session_id_of(session)
        if not run_ids and session_id is None:
            raise ValueError("Dashboard needs training_run_id= (an id or a TrainingClient, or a list of them) or session=")
        self.scope = f"run{'s' if len(run_ids) > 1 else ''} {', '.join(run_ids)}" if run_ids else f"session {session_id}"
        # What the usage API is asked, one query per run given (each run's scope holds its rollouts,
        # which a session filter would not narrow to the runs), else one for the session; each with its
        # own cursor, since one run's rows and another's interleave in the ledger.
        self._scopes = [{"training_run_id": r, "session_id": session_id} for r in run_ids] or [{"session_id": session_id}]
        self._cursors = [0] * len(self._scopes)
        self._runs_seen: dict[str, None] = {}  # the runs whose rows this dashboard read, in order
        self._spent: dict[str, float] = {}  # x="cost": run id -> its cost so far, in ledger order
        self._cost_cursors: dict[str, int] = {}  # x="cost" on a session: each run's own usage scope's cursor
        self.panel_of = {name: title for title, names in (panels or {}).items() for name in names}
        self.label_of = dict(labels or {})  # metric -> its trace's name
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing is the moving average's weight of the past, from 0 (none) to below 1, not {smoothing}")
        self.smoothing = smoothing
        self._run_names: dict[str, str] = {}  # run id -> what its traces are called
        self._closed: dict[str | None, int] = {}  # run id -> the newest optimizer step the ledger shows it took
        self.slots: dict[str, w.Output] = {}  # panel title -> the output that shows it, in drawing order
        self.figures: dict[str, go.Figure] = {}  # panel title -> the figure it shows
        self._drawn: dict[str, tuple] = {}  # panel title -> the (series, skipped, flags, costs) its figure shows
        self.panels = w.Box(layout=w.Layout(display="flex", flex_flow="row wrap", width="100%"))
        self.note = w.HTML()  # what is not drawn yet, in words
        self.alerts = w.HTML()  # the flagged steps, in words
        self.refused = w.HTML()  # the requests the backend refused (a budget's 402: no step trained), in red
        self.clicks: PlotClicks | None = None  # a PlotClicks, once something listens to clicks on the plots (on_click)
        self.inspector = None  # the RolloutInspector of rollouts()
        self._rollout_logs: dict = {}  # run name (None: no run given) -> its RolloutLog, from rollouts()
        self.stats = w.HTML()
        super().__init__([self.refused, self.note, self.alerts, self.panels, self.stats])
        self.add_class("wb-dashboard")
        self.training_run_ids, self.session_id = run_ids, session_id
        self.training_run_id = run_ids[0] if run_ids else None
        self._losses: dict[tuple[str | None, int], list[float]] = {}  # (run, step) -> its losses, insertion-ordered
        self._step_costs: dict[str, dict[int, float]] = {}  # what step_costs shows, as the poller builds it
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
        new, totals, refused = 0, [], []
        for i, scope in enumerate(self._scopes):
            for report in self._pages(scope, self._cursors[i]):
                for row in report["series"]:
                    self._take(row)
                    if self.x == "cost" and (run := scope.get("training_run_id")):
                        self._count_cost(run, row)
                self._cursors[i] = report["cursor"]
                new += len(report["series"])
            totals.append(report["totals"])
            refused.append(report.get("refusals"))
        if self.x == "cost" and not self.training_run_ids:
            # A session's rows hold its runs' own requests, but not which run a rollout's sampling was for:
            # each run's own scope does (its samplers' rows), so each run's cost is read from there.
            for run in list(self._runs_seen):
                for report in self._pages({"training_run_id": run}, self._cost_cursors.get(run, 0)):
                    for row in report["series"]:
                        self._count_cost(run, row)
                    self._cost_cursors[run] = report["cursor"]
        # A custom loss's surrogate becomes the user's loss once this process has its result.
        values = [sum(sdk_hooks.user_loss(run, loss) for loss in losses) for (run, _), losses in self._losses.items()]
        with self.hold_trait_notifications():
            if values != self.loss_values:
                self.loss_runs = [run for run, _ in self._losses]
                self.loss_steps = [step for _, step in self._losses]
                self.loss_values = values
            if self.x == "cost" and self._step_costs != self.step_costs:
                self.step_costs = copy.deepcopy(self._step_costs)
            self.cursor = max(self._cursors)
            self.cost = sum(part["cost"] for part in totals)
            self.requests = sum(part["requests"] for part in totals)
            self.tokens = {k: sum(part[f"{k}_tokens"] for part in totals) for k in ("prefill", "sample", "train")}
            self.refusals = combined_refusals(refused) or {}
            self.error = ""
        line = refusal_text(self.refusals)  # (an unchanged value sends the page nothing: traitlets compare)
        self.refused.value = (f'<div class="wb-refusals" style="color:var(--jp-error-color1, #d32f2f);'
                              f'font:12px sans-serif">{html.escape(line)}</div>' if line else "")
        return new

    def _pages(self, scope: dict, after: int):
        """The usage API's answers for `scope` after ledger row `after`: a page of PAGE rows at a time
        (a long run read for the first time takes several)."""
        while True:
            report = self.connection.usage(**scope, after=after, limit=PAGE)
            yield report
            after = report["cursor"]
            if len(report["series"]) < PAGE:
                return

    def _count_cost(self, run: str, row: dict) -> None:
        """One row of `run`'s usage scope, in ledger order: its cost adds to the run's, and a row of the
        run's own marks the step it belongs to as costing that much so far. A forward_backward (or any
        request) made after k optimizer steps (its `step`, k) belongs to step k + 1; the optim_step that
        finishes step k (its `step`, k after it) is the last row of step k. So step k's cost is what the
        run had spent when it finished the step, its rollouts' sampling before it included; step 0
        is what it had spent before its first step (a first eval's sampling, say)."""
        spent = self._spent.get(run, 0.0)
        costs = self._step_costs.setdefault(run, {})
        if row.get("training_run_id") == run and row.get("step") is not None:
            step = int(row["step"]) + (row["request_type"] != "OptimStep")
            if step == 1:
                costs.setdefault(0, spent)
            costs[step] = spent = spent + float(row.get("cost") or 0.0)
        else:
            spent += float(row.get("cost") or 0.0)
        self._spent[run] = spent

    def _take(self, row: dict) -> None:
        """One ledger row: a forward_backward's loss goes to the optimizer step it leads to."""
        run, step = row.get("training_run_id"), row.get("step")
        if run:
            self._runs_seen.setdefault(run)
        if step is None:
            return
        if row["request_type"] == "OptimStep":
            self._closed[run] = int(step)
            return
        loss = (row.get("metrics") or {}).get("loss:sum")
        if row["request_type"] != LOSS_TYPE or loss is None:
            return
        key = (run, int(step) + 1)
        if key[1] <= self._closed.get(run, 0):  # a step already taken, taken again: the run was taken back (undo)
            self._losses[key] = []
            self._closed[run] = key[1] - 1
        self._losses.setdefault(key, []).append(float(loss))

    def log(self, step: int, run=None, **values: float) -> None:
        """Record metrics computed in the notebook (reward=..., kl=...) at `step`, of `run` (a TrainingClient or
        run id: one trace per run) or of no run in particular (docs/workbench.md, "Inside the workbench")."""
        run_id = self.run_id_named(run) if isinstance(run, str) else run_id_of(run)
        metrics = {name: {"steps": list(m["steps"]), "values": list(m["values"]),
                          "runs": list(m.get("runs", [None] * len(m["steps"])))} for name, m in self.metrics.items()}
        for name, value in values.items():
            series = metrics.setdefault(name, {"steps": [], "values": [], "runs": []})
            series["steps"].append(int(step))
            series["values"].append(float(value))
            series["runs"].append(run_id)
        self.metrics = metrics  # a new dict, so traitlets observers see the change
        self._redraw()

    def skip(self, step: int, why: str, run=None) -> None:
        """Mark `step` (of `run`, a name or id, if given: the mark names it) as taken without training
        (e.g. why="every group tied"): docs/workbench.md, "Inside the workbench"."""
        if run is not None:
            why = f"{why} · {self._called(run)}"
        skipped = {reason: list(steps) for reason, steps in self.skipped.items()}
        steps = skipped.setdefault(why, [])
        if int(step) not in steps:
            steps.append(int(step))
        self.skipped = skipped
        self._redraw()

    def flag(self, step: int, kind: str, detail: str, run=None) -> None:
        """Mark `step` (of `run`, a name or id, if given) as showing trouble of `kind` ("collapse", "kl"),
        with the evidence in words (docs/workbench.md, "Inside the workbench")."""
        flag = {"step": int(step), "kind": str(kind), "detail": str(detail),
                **({"run": self._called(run)} if run is not None else {})}
        if flag not in self.flags:
            self.flags = [*self.flags, flag]
            self._redraw()

    # ---- clicks and rollouts -------------------------------------------------------------------------

    def on_click(self, callback, hint: str = "") -> None:
        """Call `callback(step, panel_title, trace_name)` when a point of any panel is clicked in the page;
        `hint`, when given, is the line above the plots that says what a click does."""
        if self.clicks is None:
            from workbench.widgets.plot_clicks import PlotClicks

            # The hint goes in with the widget's first state: set after it is shown (from the recipe's thread),
            # a busy page could draw the widget empty and keep it so.
            self.clicks = PlotClicks(hint)
            self.children = (self.clicks, *self.children)
        elif hint:
            self.clicks.hint = hint
        self.clicks.on_click(callback)

    def rollouts(self, path, tokenizer=None, run=None):
        """Show the rollouts an RL run stores per step (a folder, or a rollout_log.RolloutLog) below the
        plots, on the newest step until a step is chosen; clicking a point opens its step (of the run
        whose trace it is, when several runs' rollouts were given with `run=`, a name or id). Called
        again (common.plot_to does, every step), it picks up the steps written since."""
        from workbench.recipes.rollout_log import RolloutLog
        from workbench.widgets.rollouts import RolloutInspector

        store = path if isinstance(path, RolloutLog) else RolloutLog(path)
        name = None if run is None else self._called(run)
        self._rollout_logs[name] = store
        if self.inspector is None:
            self.inspector = RolloutInspector(tokenizer=tokenizer, store=store, label=name or "")
            self.children = (*self.children, self.inspector)
            hint = "Click a point of a plot to open that step's rollouts below."
            if self.clicks is None:
                self.on_click(self._open_step, hint)
            else:
                self.clicks.hint = hint
        elif self.inspector.follow and self.inspector.store.path != store.path:
            self.inspector.show_log(store, label=name or "")  # a new run's rollouts, followed until a step is chosen
        self.inspector.refresh()
        return self.inspector

    def _open_step(self, step: int, title: str, trace: str) -> None:
        if self.inspector is None:
            return
        # The run whose trace was clicked: a metric's trace is "metric · run", the loss's is "run".
        name = next((n for n in self._rollout_logs if n and (trace == n or trace.endswith(f" · {n}"))), None)
        store = self._rollout_logs.get(name, self.inspector.store)
        if step not in store.steps():
            self.inspector.error = f"no rollouts stored for step {step} ({title}): steps kept are {store.describe()}"
            return
        self.inspector.follow = False  # the person chose a step: later steps of the run do not move it
        if store is not self.inspector.store:
            self.inspector.show_log(store, label=name or "")
        self.inspector.show_step(step)

    # ---- drawing -------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Redraw now (the throttle may be holding back the latest points)."""
        self._redraw.flush()

    def _draw(self) -> None:
        with self._draw_lock:
            self._draw_now()

    def panel_series(self) -> dict[str, tuple[str, dict[str, tuple[list, list]]]]:
        """What each panel shows: title -> (y-axis title, {trace name: (steps, values)}), smoothed if asked."""
        return {title: (y_title, {name: (steps, values) for name, (_, steps, values) in traces.items()})
                for title, (y_title, traces) in self._panels().items()}

    def _panels(self) -> dict[str, tuple[str, dict[str, tuple[str | None, list, list]]]]:
        """panel_series, each trace with the run it belongs to (None: a metric logged with no run)."""
        by_run: dict[str, tuple[str | None, list, list]] = {}
        for run, step, value in zip(self.loss_runs, self.loss_steps, self.loss_values):
            _, xs, ys = by_run.setdefault(self.run_name(run) if run else "loss", (run, [], []))
            xs.append(step)
            ys.append(value)
        panels = {LOSS_PANEL: ("loss:sum", by_run)} if by_run else {}
        for name, m in self.metrics.items():
            title = self.panel_of.get(name, name)
            label = self.label_of.get(name, name)
            for run in dict.fromkeys(m.get("runs") or [None]):  # one trace per run, in the order first logged
                points = self.points(name, run)
                trace = label if run is None else f"{label} · {self.run_name(run)}"
                panels.setdefault(title, (title, {}))[1][trace] = (run, [s for s, _ in points], [v for _, v in points])
        if self.smoothing:
            for _, traces in panels.values():
                for trace, (run, xs, ys) in traces.items():
                    traces[trace] = (run, xs, _smoothed(ys, self.smoothing))
        return panels

    def cost_at(self, step: int, run: str | None = None) -> float | None:
        """x="cost": what `run` (default: the dashboard's first run) had spent when it finished `step`
        (step_costs), or None while the ledger has not shown that step yet."""
        run = run or next(iter([*self.training_run_ids, *self._runs_seen]), None)
        costs = self.step_costs.get(run, {}) if run is not None else {}  # no run known yet: nothing priced
        return costs.get(int(step))

    def run_id_named(self, run: str) -> str:
        """`run` as a run id: the id of the run this dashboard knows by that name (its scope's runs, the
        session's, those it has plotted), else `run` itself, taken as an id."""
        known = [*self.training_run_ids, *self.loss_runs,
                 *(r for m in self.metrics.values() for r in m.get("runs", []) if r)]
        if run in known:
            return run
        if not any(self.run_name(r) == run for r in known):
            # A run named before any of its rows reached this dashboard (a fork about to take its first step):
            # look among its session's runs, this dashboard's session or that of the runs it was given (a run id
            # is "<session>:train:<n>", service/checkpoints.py).
            for session_id in dict.fromkeys([self.session_id] if self.session_id else
                                            [r.split(":train:")[0] for r in self.training_run_ids]):
                response = self.connection.http.get(f"/api/v1/sessions/{session_id}")
                if response.status_code == 200:
                    known += response.json().get("training_run_ids", [])
        return next((r for r in dict.fromkeys(known) if self.run_name(r) == run), run)

    def _called(self, run) -> str:
        """What a run given as a name, an id or a TrainingClient is called on this dashboard."""
        run_id = self.run_id_named(run) if isinstance(run, str) else run_id_of(run)
        if run_id is None:  # (run_name(None) could only fail: no run is named "None")
            raise ValueError(f"no training run id in {run!r}")
        return self.run_name(run_id)

    def points(self, name: str, run_id: str | None) -> list[tuple[int, float]]:
        """The (step, value) points logged for metric `name` of one run (None: of no run in particular)."""
        m = self.metrics.get(name, {"steps": [], "values": []})
        runs = m.get("runs") or [None] * len(m["steps"])
        return [(s, v) for s, v, r in zip(m["steps"], m["values"], runs) if r == run_id]

    def run_name(self, run_id: str) -> str:
        """What a run's traces are called (runs.run_label), asked of the backend once per run."""
        if run_id not in self._run_names:
            meta = None
            try:
                response = self.connection.http.get(f"/api/v1/training_runs/{run_id}")
                if response.status_code == 200:
                    meta = response.json().get("user_metadata")
            except Exception:  # noqa: BLE001 - a name is a nicety; a backend that went away shows in the stats line
                pass
            self._run_names[run_id] = run_label(run_id, meta)
        return self._run_names[run_id]

    def _draw_now(self) -> None:
        panels = self._panels()
        skipped = {why: sorted(steps) for why, steps in self.skipped.items()}
        flags = list(self.flags)
        costs = self.step_costs if self.x == "cost" else None
        for title, (y_title, traces) in panels.items():
            series = {name: (steps, values) for name, (_, steps, values) in traces.items()}
            run_of = {name: run for name, (run, _, _) in traces.items()}
            if self._drawn.get(title) == (series, skipped, flags, costs):
                continue
            # Each panel is an Output showing the figure as data (plotly's mimetype), replaced whole
            # when its points change. Not a plotly FigureWidget: each of those carries plotly.js
            # (5 MB) in its synced state, so a page reload that restores a few of them from the
            # kernel fails ("model not found" for every widget), and its in-place edits are
            # messages that a view still drawing misses.
            if title not in self.slots:
                self.slots[title] = w.Output(layout=w.Layout(width=f"{PANEL_WIDTH + 10}px"))
                self.panels.children = (*self.panels.children, self.slots[title])
            # Against cost, a mark (a skip, a flag) sits at its step's cost on the dashboard's first run.
            x_of = (lambda trace, step: self.cost_at(step, run_of.get(trace))) if costs is not None else None
            self.figures[title] = _figure(title, y_title, series, skipped, flags, x_of)
            self.slots[title].outputs = (_as_output(self.figures[title]),)
            self._drawn[title] = copy.deepcopy((series, skipped, flags, costs))
        self.note.value = self._note(panels)
        self.alerts.value = _alerts(flags)
        tok = self.tokens
        error = f" · <span style='color:#b00'>{html.escape(self.error)}</span>" if self.error else ""
        self.stats.value = (
            f"<span class='wb-dashboard-cost' style='font:12px sans-serif' data-cost='{self.cost!r}'>"
            f"{html.escape(self.scope)} · tokens: prefill {tok.get('prefill', 0):,} · sample {tok.get('sample', 0):,} · "
            f"train {tok.get('train', 0):,} · {self.requests} requests · <b>cost {format_cost(self.cost)}</b>"
            f"{error}</span>"
        )

    def _note(self, panels: dict) -> str:
        waiting = []
        if LOSS_PANEL not in panels:
            waiting.append("the loss of each forward_backward (none has run yet)")
        # Only metrics this dashboard was told to expect (named in `panels`): a notebook that logs
        # none should not be told how to log them.
        expected = [name for name in self.panel_of if name not in self.metrics]
        if expected:
            waiting.append(f"{', '.join(expected)} (logged by the notebook: dashboard.log(step, {expected[0]}=...))")
        if not waiting:
            return ""
        return ("<div class='wb-dashboard-empty' style='font:12px sans-serif;color:#666'>Not plotted yet: "
                + "; ".join(waiting) + ".</div>")

    def watch(self, probes, training_client, **kwargs):
        """Show what each of `training_client`'s steps changes on `probes` below the plots (workbench/widgets/probes.py)."""
        from workbench.widgets.probes import Probes

        self.probes = Probes(training_client, probes, connection=self.connection, **kwargs)
        self.children = (*self.children, self.probes)
        return self.probes

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
        if not hasattr(self, "_poller"):  # its constructor refused its arguments: it has nothing of its own
            return super().close()
        self.stop()
        for child in (*self.slots.values(), self.panels, self.note, self.alerts, self.stats,
                      *(c for c in (self.clicks, self.inspector) if c is not None)):
            child.close()
        super().close()
