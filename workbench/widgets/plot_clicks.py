"""Clicks on a dashboard's plots, reported to Python.

The dashboard's panels are plotly figures shown as output data (workbench/widgets/dashboard.py says
why they are not FigureWidgets), so plotly.py never hears of a click. This widget, placed inside the
dashboard, finds the plotly plots drawn in that dashboard and listens to their `plotly_click`; a
click sets `clicked` ({title, trace, step, n}: the panel, the trace, the point's step, a count so
two clicks on one point are two changes) and runs the `on_click(callback)` callbacks with
(step, title, trace). Its one visible line is `hint`, which says what a click does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import anywidget
import traitlets as t


class PlotClicks(anywidget.AnyWidget):
    _esm = Path(__file__).with_name("plot_clicks.js")
    hint = t.Unicode("").tag(sync=True)
    clicked = t.Dict().tag(sync=True)

    def __init__(self, hint: str = ""):
        super().__init__(hint=hint)
        self._callbacks: list[Callable[[int, str, str], object]] = []
        self.observe(self._clicked, names=["clicked"])

    def on_click(self, callback: Callable[[int, str, str], object]) -> None:
        """Call `callback(step, title, trace)` on every click on a point of the dashboard's plots."""
        self._callbacks.append(callback)

    def _clicked(self, change) -> None:
        click = change["new"] or {}
        if not isinstance(click.get("step"), (int, float)):
            return
        for callback in self._callbacks:
            callback(int(click["step"]), str(click.get("title", "")), str(click.get("trace", "")))
