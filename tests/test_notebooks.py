"""Every notebook as a researcher sees it: run in JupyterLab (the wheel's extension) in Debian's
Chromium, with small step counts, and checked from the page itself, not from Python state.

One JupyterLab and one local backend serve every test here (tests/browser.py): each notebook calls
plain `workbench.connect()`, and the first one's backend is shared by the others, as a researcher's
notebooks share it. Kernels stay alive until the end, so every session is still running when the
next notebook's checks read the sidebar. For each notebook:

- no output shows "Error displaying widget", a traceback, or stderr (ALLOWED_STDERR names the
  warnings a user should see and act on; none today);
- every plot has a title, labelled axes, and a trace with a point at every step run (or, at a
  step skipped for having nothing to train on, that plot's "skipped (why)" mark); a panel with
  nothing to show says so in words (plotly's own data in the page: `el.data`, `el.layout`);
- the CostMeter, the dashboard's cost line, the sidebar's row and the status bar show the tokens
  by kind and the cost of GET /api/v1/usage for the notebook's session, to their display precision;
- the session is named after its notebook in the sidebar;
- after a page reload no widget is broken and every plot draws again;
- nothing is written next to the notebook (metrics and labels go to $STEPWISE_HOME/runs);
- a screenshot lands in tests/_artifacts/notebook-<name>.png.

The labeler is also driven by hand, as a person labels: its "cut off" mark, a key press, the next
pair, the labels file (tests/_artifacts/labeler-cut-off.png). The preference notebook runs the live
loop as a person does: Run All with nobody labelling (its summary says 0 pairs, nothing errs), then
12 key presses, one while an update trains, an edit typed in, an undo, and its summary cell again
(tests/_artifacts/labeler-live-*.png). The RL notebook runs with
groups small enough that a step ties and is skipped: one step count everywhere, the skipped step
marked on the plots and counted in the summary; a rollout's token colours have a legend
(tests/_artifacts/rollouts-legend.png).

The budget notebook (07) runs into its budget: while its cells run, the status bar and the sidebar's
budget bar are watched turning amber at 80% and red when the backend refuses; the meters frozen at
those moments, and the loss plotted against cost (a point per step), are checked after
(tests/_artifacts/budget-*.png).

The quickstart and the SFT notebook run at the same time, in two tabs: both train, and both
sessions are in the sidebar under their notebooks' names. The RL insight notebook (06) is driven by
the mouse: a click on a point of a plot opens that step's rollouts (tests/_artifacts/rl-insight-*.png).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import warnings
from pathlib import Path

import pytest

from browser import (ARTIFACTS, NEEDS_CHROMIUM, backend_api, open_notebook, run_all, run_state, save,
                     wait_for_kernel, wait_until_run, write_notebook)
from workbench.widgets.cost import budget_text, format_cost

pytestmark = NEEDS_CHROMIUM

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
ALLOWED_STDERR: list[tuple[str, str]] = []  # (name, regex) of warnings a user should act on; none today


def format_tokens(tokens: int) -> str:
    """extension/src/format.ts formatTokens, for reading the sidebar and the status bar."""
    def trim(value: float) -> str:
        return re.sub(r"\.0$", "", f"{value:.0f}" if value >= 100 else f"{value:.1f}")

    if tokens < 1000:
        return str(round(tokens))
    return f"{trim(tokens / 1000)}k" if tokens < 1_000_000 else f"{trim(tokens / 1_000_000)}M"


def eventually(check, timeout: float = 30.0, what: str = ""):
    """Call `check()` until it stops raising AssertionError (widgets poll every second or two)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def until(predicate, timeout: float = 30.0, what=""):
    """Wait until `predicate()` is true (an AssertionError naming `what` after `timeout` seconds; a
    callable `what` is called then, to say what the page showed instead)."""
    def check():
        assert predicate(), f"waited {timeout:.0f} s for {what() if callable(what) else what}"
    eventually(check, timeout, what)


# ---- what the page shows ----------------------------------------------------------------------------


def problems(page) -> list[str]:
    """Broken widgets, tracebacks and stderr in the notebook's outputs, minus the allowed warnings."""
    found = []
    text = page.locator(".jp-Notebook").text_content()
    if "Error displaying widget" in text:
        found.append("a broken widget: " + text[text.index("Error displaying widget"):][:200])
    for output in page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'],"
                               ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']").all():
        message = output.text_content().strip()
        if not any(re.search(pattern, message) for _, pattern in ALLOWED_STDERR):
            found.append(message[:600])
    return found


def plots(page) -> list[dict]:
    """Every plotly plot in the notebook: its title, axis titles, each trace's steps (the x of its
    points; a break in a line, y null, is no point), and whether it fits."""
    return page.evaluate("""() => [...document.querySelectorAll('.jp-Notebook .js-plotly-plot')].map(el => {
        const output = el.closest('.jp-OutputArea-output').getBoundingClientRect();
        const box = el.getBoundingClientRect();
        const title = t => (t && (t.text ?? t)) || '';
        return {title: title(el.layout.title), x: title(el.layout.xaxis.title), y: title(el.layout.yaxis.title),
                traces: el.data.map(t => ({name: t.name, steps: [...(t.x || [])].filter((_, i) => t.y[i] !== null),
                                           y: [...(t.y || [])].filter(y => y !== null)})),
                fits: box.right <= output.right + 1, drawn: el.querySelectorAll('.scatterlayer .trace').length,
                // The legend: its entries, and whether any is cut off (outside the plot, or behind a legend scrollbar).
                legend: el.querySelectorAll('.legend .traces').length,
                legend_cut: [...el.querySelectorAll('.legend .traces')].some(entry => {
                    const e = entry.getBoundingClientRect();
                    return e.bottom > box.bottom + 1 || e.top < box.top - 1 || e.right > box.right + 1;
                }) || [...el.querySelectorAll('.legend .scrollbar')].some(bar => bar.getBoundingClientRect().height > 0)};
    })""")


def drawn_points(page) -> dict[str, dict[str, list]]:
    """Each plot's drawn points, by title then trace name: their boxes on the page [left, top, right, bottom]."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('.jp-Notebook .js-plotly-plot')].map(el => [
        (el.layout.title.text ?? el.layout.title),
        Object.fromEntries([...el.querySelectorAll('.scatterlayer .trace')].map(g => [
            g.__data__[0].trace.name,
            [...g.querySelectorAll('path.point')].map(p => {
                const r = p.getBoundingClientRect();
                return [r.left, r.top, r.right, r.bottom];
            })]))]))""")


def hover_inside(page, title: str, trace: str) -> None:
    """Hover the first point of `trace` in plot `title`: its hover label must lie inside the plot, not be cut
    off at an edge."""
    find = """(title) => [...document.querySelectorAll('.jp-Notebook .js-plotly-plot')]
                   .find(el => (el.layout.title.text ?? el.layout.title) === title)"""
    centre = page.evaluate(f"""([title, trace]) => {{
        const el = ({find})(title);
        el.scrollIntoView({{block: 'center'}});
        const g = [...el.querySelectorAll('.scatterlayer .trace')].find(g => g.__data__[0].trace.name === trace);
        const r = g.querySelector('path.point').getBoundingClientRect();
        return [(r.left + r.right) / 2, (r.top + r.bottom) / 2];
    }}""", [title, trace])
    page.mouse.move(*centre)

    def inside():
        boxes = page.evaluate(f"""(title) => {{
            const el = ({find})(title);
            const label = el.querySelector('.hoverlayer .hovertext');
            const r = el.getBoundingClientRect(), l = label && label.getBoundingClientRect();
            return label && [r.left, r.top, r.right, l.left, l.top, l.right];
        }}""", title)
        assert boxes, "no hover label"
        left, top, right, label_left, label_top, label_right = boxes
        assert left - 1 <= label_left and label_right <= right + 1 and top - 1 <= label_top, (boxes, title)
    eventually(inside)


def overlapping(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def skip_marks(plot: dict) -> dict[str, list[int]]:
    """A plot's "skipped (why)" traces: why -> the steps marked."""
    return {t["name"]: t["steps"] for t in plot["traces"] if t["name"].startswith("skipped (")}


def check_plots(page, steps: int, expected_panels: set[str]) -> list[dict]:
    shown = plots(page)
    assert {p["title"] for p in shown} == expected_panels, shown
    every_step = set(range(1, steps + 1))
    for plot in shown:
        assert plot["title"] and plot["x"] == "step" and plot["y"], plot
        if len(plot["traces"]) > 1:  # every entry of the legend shown, none cut off
            assert plot["legend"] == len(plot["traces"]) and not plot["legend_cut"], (plot["title"], plot["legend"])
        skipped = {s for marked in skip_marks(plot).values() for s in marked}
        assert any(set(t["steps"]) | skipped == every_step for t in plot["traces"]), (steps, plot)
        assert plot["drawn"] == len(plot["traces"]) and plot["fits"], plot
    return shown


def session_of(lab: dict, notebook: str) -> dict:
    """The notebook's running session (named after it), and its usage totals from the usage API."""
    api = backend_api(lab)
    rows = [s for s in api.get("/api/v1/usage/sessions").json()["sessions"]
            if s["display_name"] == notebook and s["status"] == "active"]
    assert len(rows) == 1, [(s["display_name"], s["status"]) for s in api.get("/api/v1/usage/sessions").json()["sessions"]]
    totals = api.get("/api/v1/usage", params={"session_id": rows[0]["session_id"], "limit": 1}).json()["totals"]
    return {"id": rows[0]["session_id"], **totals}


def check_costs(page, lab: dict, notebook: str) -> dict:
    """CostMeter, dashboard cost line, sidebar row and status bar against GET /api/v1/usage."""
    usage = session_of(lab, notebook)
    assert usage["cost"] > 0 and usage["train_tokens"] > 0
    kinds = ("prefill", "sample", "train")

    def meter():
        (table,) = page.locator(".wb-cost").all()
        for kind in kinds:
            row = table.locator(f"tr[data-kind='{kind}']")
            assert row.locator(".wb-cost-tokens").text_content() == f"{usage[f'{kind}_tokens']:,}"
        assert table.locator("tr[data-kind='total'] .wb-cost-cost").text_content() == format_cost(usage["cost"])
        assert usage["id"] in table.text_content()

    def dashboard():
        line = page.locator(".wb-dashboard-cost").text_content()
        for kind in kinds:
            assert f"{kind} {usage[f'{kind}_tokens']:,}" in line, line
        assert f"cost {format_cost(usage['cost'])}" in line and usage["id"] in line, line

    def sidebar():
        row = page.locator(f"li.jp-StepwiseSession[data-name='{notebook}']")
        assert row.count() == 1 and row.get_attribute("data-status") == "active"
        assert row.locator(".jp-StepwiseSession-title").text_content() == notebook
        for kind in kinds:
            assert row.get_attribute(f"data-{kind}-tokens") == str(usage[f"{kind}_tokens"])
            assert row.locator(f".jp-StepwiseSession-{kind}").text_content() == \
                f"{kind} {format_tokens(usage[f'{kind}_tokens'])}"
        assert math.isclose(float(row.get_attribute("data-cost")), usage["cost"], rel_tol=1e-12)
        assert row.locator(".jp-StepwiseSession-cost").text_content() == format_cost(usage["cost"])

    def status_bar():
        status = page.locator(".jp-StepwiseCost")
        assert status.get_attribute("data-notebook") == notebook
        for kind in kinds:
            assert status.get_attribute(f"data-{kind}-tokens") == str(usage[f"{kind}_tokens"])
        assert math.isclose(float(status.get_attribute("data-cost")), usage["cost"], rel_tol=1e-12)
        tokens = sum(usage[f"{kind}_tokens"] for kind in kinds)
        assert status.text_content().startswith(f"Stepwise notebook {format_cost(usage['cost'])} · {format_tokens(tokens)} tok · lab $")
        assert float(status.get_attribute("data-lab-cost")) >= usage["cost"]

    open_sidebar(page)
    for check in (meter, dashboard, sidebar, status_bar):
        eventually(check, what=check.__name__)
    return usage


def open_sidebar(page) -> None:
    tab = page.locator('.jp-SideBar [data-id="stepwise-sessions"]')
    if tab.get_attribute("aria-selected") != "true":
        tab.click()


def check_reload(page, shown: list[dict], notebook: Path) -> None:
    """Saved, then reloaded with the kernel still running (what a person does, or autosave): every
    widget comes back from the kernel, none broken, every plot with all its points. ("model not found" after a
    reload was the kernel's answer to the page lost to a race with the threads that make widgets, fixed in
    workbench/client/widget_states.py; reload_and_wait says what is left of it.)"""
    save(page)

    def restored():
        assert not problems(page), problems(page)
        assert page.locator(".wb-cost").count() == 1
        assert plots(page) == shown
    reload_and_wait(page, notebook, restored)


def shown_widgets(notebook: Path) -> list[str]:
    """The model ids of the widgets a saved notebook's outputs show."""
    import nbformat

    saved = nbformat.read(notebook, as_version=4)
    return [output["data"][WIDGET_VIEW]["model_id"] for cell in saved.cells for output in cell.get("outputs", [])
            if WIDGET_VIEW in output.get("data", {})]


def reload_and_wait(page, notebook: Path, check, what: str = "reload") -> None:
    """Reload the page (its notebook saved) and wait until `check()` passes.

    One failure is ipywidgets' page side, not ours: a view whose model is not there yet polls for it for 2 s
    (get_model) and, after a stall of a busy page, gives up without looking once more, so it stays "model not
    found" though the kernel's answer held the model (jupyter-widgets/ipywidgets#4026, mitigated by #4033 in
    8.1.9, #4040 open). Only that, proven from the page's websocket (every widget the saved notebook shows in the
    kernel's answer, none closed), earns one more reload and a warning in the run's summary; any other failure
    fails at once."""
    with widget_traffic(page, shown_widgets(notebook)) as heard:
        for attempt in (1, 2):
            heard.clear()
            page.reload()
            wait_for_kernel(page)
            try:
                eventually(check, timeout=60)
                return
            except AssertionError:
                print(f"{what} (attempt {attempt}): what the page sent and heard", *heard, sep="\n")
                if attempt == 2 or not renderer_gave_up(heard):
                    raise
                # A warning, so that the run's summary shows each time it happened (a passing test's output is not
                # shown).
                warnings.warn(f"{what}: ipywidgets' renderer gave up on a model the kernel sent (ipywidgets#4026); "
                              "reloaded once more")


def renderer_gave_up(heard: list) -> bool:
    """Whether the traffic of a reload shows ipywidgets#4026: the kernel answered with every shown widget and closed
    none, and a view still found no model."""
    answers = [h for h in heard if h[1] == "heard" and h[2] in ("update_states", "comm_info_reply")]
    return (bool(answers) and all(len(h) == 4 for h in answers)  # (a 5th item: "lacks shown widgets [...]")
            and not any(h[2] == "comm_close of a shown widget" for h in heard if len(h) > 2)
            and any(h[1] == "console" and "widget model not found" in h[2] for h in heard))


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator(".wb-dashboard").first.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / f"notebook-{Path(name).stem}.png"))


def check_notebook(page, lab: dict, name: str, steps: int, panels: set[str]) -> dict:
    assert not problems(page), problems(page)
    shown = check_plots(page, steps, panels)
    usage = check_costs(page, lab, name)
    screenshot(page, name)
    check_reload(page, shown, lab["root"] / name)
    return usage


def run_notebooks(lab: dict, browser, notebooks: list[tuple[str, dict]], while_running=None) -> list:
    """Open and Run All each notebook, then wait until all have run; `while_running(pages)` is called between."""
    pages = []
    for name, parameters in notebooks:
        write_notebook(lab, NOTEBOOKS / name, parameters)
        page = browser.new_page()
        open_notebook(page, lab, name)
        run_all(page)
        pages.append(page)
    if while_running is not None:
        while_running(pages)
    wait_until_run(pages, lab)
    return pages


def reopen_while_training(browser, lab: dict, page, name: str) -> None:
    """Once the dashboard is up and training, save and open the notebook in a second tab, as a person reopening it
    does: its widgets come back from the kernel within seconds while the cell still runs (awaited on a worker
    thread, workbench/client/in_thread.py: a blocking cell keeps the kernel from answering them until it ends)."""
    def training():
        assert page.locator(".wb-dashboard .js-plotly-plot").count() >= 1
    eventually(training, timeout=120)
    save(page)
    again = browser.new_page()
    again.set_default_timeout(30_000)
    again.goto(f"{lab['url']}/lab/tree/{name}")
    start = time.monotonic()

    def widgets_back():
        text = again.locator(".jp-Notebook").text_content()
        assert "Error displaying widget" not in text and "Loading widget" not in text, text[-500:]
        assert again.locator(".wb-dashboard").count() >= 1
    eventually(widgets_back, timeout=30)
    assert "[*]" in "".join(run_state(page)["prompts"]), \
        "the widgets came back only once the notebook had finished (a cell blocking the kernel?)"
    print(f"widgets back in a reopened tab {time.monotonic() - start:.1f} s into the run")
    again.close()


@pytest.fixture(autouse=True)
def nothing_written_next_to_the_notebooks(lab):
    def listing() -> set[str]:  # JupyterLab's own folders (_settings, ...) and hidden files aside
        return {p.name for p in lab["root"].iterdir() if not p.name.startswith(("_", "."))}

    before = listing()
    yield
    written = listing() - before - {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    assert not written, f"the notebooks wrote {written} into their folder (outputs belong under STEPWISE_HOME)"


# ---- the notebooks ---------------------------------------------------------------------------------------


LOSS = "loss per step (loss:sum, summed over tokens)"


def test_quickstart_and_sft_train_side_by_side(lab, browser):
    quickstart, sft = run_notebooks(lab, browser, [("00_quickstart.ipynb", {"steps": 3}),
                                                   ("01_sft.ipynb", {"steps": 3, "sample_questions": 2})])
    assert "answer:" in quickstart.locator(".jp-Notebook").text_content()
    # The quickstart logs no metrics of its own, so its dashboard announces none (no hint to call
    # dashboard.log in a notebook that never does); SFT's, whose panels name its metrics, drew them.
    for page in (quickstart, sft):
        assert page.locator(".wb-dashboard-empty").count() == 0
    assert "dashboard.log(" not in quickstart.locator(".jp-Notebook").text_content()
    assert "eval_loss:" in sft.locator(".jp-Notebook").text_content()
    for page, name, panels in ((quickstart, "00_quickstart.ipynb", {LOSS}),
                               (sft, "01_sft.ipynb", {LOSS, "loss per assistant token"})):
        page.bring_to_front()
        usage = check_notebook(page, lab, name, 3, panels)
        assert usage["sample_tokens"] > 0  # both sampled: the session scope includes sampling
    # Both notebooks' sessions run at once, each under its notebook's name.
    open_sidebar(sft)
    names = {r.get_attribute("data-name") for r in sft.locator("li.jp-StepwiseSession[data-status='active']").all()}
    assert {"00_quickstart.ipynb", "01_sft.ipynb"} <= names


TIED = "skipped (every group tied)"


def test_rl_notebook(lab, browser):
    """Two groups of three answers per step, from a policy right about 1 time in 10: with these seeds
    step 1's groups all tie (a step with nothing to train on) and later steps' do not. One step
    count everywhere: the summary and the progress bar say 3 steps, how many were skipped and why;
    the loss and KL plots have a point at every trained step and a mark at every skipped one, the
    same steps on every plot; the sidebar counts 3 optimizer steps. Reopened in a second tab while it trains,
    its widgets come back at once."""
    (page,) = run_notebooks(lab, browser, [("02_rl.ipynb", {"steps": 3, "loss_fn": "ppo", "eval_prompts": 2,
                                                            "groups_per_batch": 2, "group_size": 3,
                                                            "inspect_prompts": 2})],
                            while_running=lambda pages: reopen_while_training(browser, lab, pages[0], "02_rl.ipynb"))
    text = page.locator(".jp-Notebook").text_content().replace("\u2007", " ")  # tqdm's bars pad with figure spaces
    assert "Snakes, following'" in text and "{'correct': 0.0, 'format': 0.0}" in text  # the strict verifier
    assert re.search(r"held-out reward: \d\.\d\d -> \d\.\d\d", text)
    # The held-out evals showed their progress (each bar stays, complete, above the plots).
    for when in ("before", "after"):
        assert re.search(rf"held-out eval, {when} training \(2 problems x 4\)\D*100%\D*2/2", text), when
    summary = re.search(r"rl: 3 steps on \S+ \((\d) skipped: every group tied", text)
    assert summary, text[-3000:]
    skipped = int(summary[1])
    assert 1 <= skipped < 3, "these seeds should give a step whose groups all tied, and one that trained"
    assert re.search(rf"3/3 \[[^\]]*skipped={skipped} \(every group tied\)\]", text)  # the progress bar

    by_title = {p["title"]: p for p in plots(page)}
    marked = {title: skip_marks(by_title[title]) for title in (LOSS, "kl_sampler", "reward")}
    steps_marked = marked[LOSS][TIED]
    assert len(steps_marked) == skipped and all(m == {TIED: steps_marked} for m in marked.values()), marked
    for title, name in ((LOSS, None), ("kl_sampler", "kl_sampler")):
        (trained,) = [t["steps"] for t in by_title[title]["traces"] if t["name"] != TIED and name in (None, t["name"])]
        assert sorted(trained + steps_marked) == [1, 2, 3], (title, trained, steps_marked)
    open_sidebar(page)
    row = page.locator("li.jp-StepwiseSession[data-name='02_rl.ipynb']")

    def sidebar_steps():  # the session's row, or its one training run's, counts 3 optimizer steps
        assert row.count() == 1
        assert set(row.evaluate("el => [el, ...el.querySelectorAll('[data-steps]')].map(e => e.dataset.steps)"
                                ".filter(s => s !== undefined)")) == {"3"}
    eventually(sidebar_steps)

    # A rollout's tokens, coloured by logprob then by advantage, each time with the legend of its colours.
    # Every step's groups below the plots (the newest step shown), then the trained policy's own rollouts.
    assert page.locator(".wb-dashboard .wb-rollouts").get_attribute("data-step") == "3"
    inspector = page.locator(".wb-rollouts").last
    inspector.locator("tr[data-index]").first.click()
    legend = inspector.locator(".wb-legend")

    def legend_for(mode: str, words: str, swatches: int):
        assert legend.get_attribute("data-mode") == mode and words in legend.text_content(), legend.text_content()
        assert legend.locator(".wb-swatch").count() == swatches
    eventually(lambda: legend_for("logprob", "1 − p", 4))
    inspector.locator(".wb-color").select_option("advantage")
    eventually(lambda: legend_for("advantage", "red below 0, green above", 5))
    ARTIFACTS.mkdir(exist_ok=True)
    inspector.screenshot(path=str(ARTIFACTS / "rollouts-legend.png"))
    check_notebook(page, lab, "02_rl.ipynb", 3, {LOSS, "reward", "kl_sampler"})


def code_cell(page, containing: str):
    """The notebook's code cell whose source contains `containing`."""
    return page.locator(".jp-Notebook .jp-CodeCell").filter(
        has=page.locator(".jp-InputArea-editor", has_text=containing))


# Held-out pairs for the preference notebook, written by hand: a short answer beats a long one, as the
# test labels. The notebook imports them (preference_labels.import_jsonl) and never trains on them.
HELDOUT = [
    ("Describe a river.", "A river is flowing water.", "A river is a long, winding body of fresh water that flows "
     "from the mountains down through valleys and plains until it finally reaches the sea."),
    ("What is a good lunch?", "A sandwich.", "A good lunch is a balanced meal with some protein, plenty of "
     "vegetables, a little grain and a piece of fruit, eaten slowly."),
    ("Tell me about owls.", "Owls hunt at night.", "Owls are nocturnal birds of prey with large forward-facing eyes, "
     "soft feathers for silent flight and sharp talons for catching mice."),
    ("Why do we laugh?", "Laughing shows joy.", "We laugh because humor and social connection trigger a response in "
     "the brain that releases tension and helps people bond with each other."),
    ("What is snow?", "Frozen rain.", "Snow is precipitation made of small ice crystals that form in clouds when "
     "water vapor freezes and then falls to the ground in flakes."),
    ("How do fish breathe?", "With gills.", "Fish breathe by passing water over their gills, thin feathery organs "
     "that pull dissolved oxygen out of the water and into the blood."),
]


def test_preference_notebook(lab, browser):
    """Human-in-the-loop DPO, as a person labels: Run All, then 12 key presses (the shorter answer wins,
    as a person reading them would judge) with updates every 4 labels. Three updates run in the
    background; a key pressed while one trains is taken; the pairs after the first update come from
    the new weights (v >= 1); the held-out margin plotted rises; an edit (e, type, Ctrl+Enter) trains
    at once as a fourth update; undoing it says that update stays; the export holds the pairs."""
    import json

    heldout = lab["home"] / "runs" / "preference-heldout.jsonl"
    heldout.parent.mkdir(parents=True, exist_ok=True)
    heldout.write_text("".join(json.dumps({"prompt": f"{p} Answer in one sentence.", "chosen": c, "rejected": r}) + "\n"
                               for p, c, r in HELDOUT))
    (page,) = run_notebooks(lab, browser, [("03_preference.ipynb", {"update_every": 4, "auto_label": False, "labels": 0,
                                                                    "rule": "shorter", "heldout_path": str(heldout)})])
    summary = code_cell(page, "summary = live.summary()")
    outputs = summary.locator(".jp-Cell-outputArea")  # what the cell printed, not its source
    assert "0 pairs labelled" in outputs.text_content() and "0 updates" in outputs.text_content()
    assert not problems(page), problems(page)

    widget = page.locator(".wb-lab")
    text = lambda selector: widget.locator(selector).text_content()  # noqa: E731
    updates_done = lambda: int(re.match(r"(\d+) updates done", text(".wb-updates"))[1])  # noqa: E731

    def versions() -> tuple[int, int]:
        """(the weights that sampled the pair on show, the latest weights), as the widget says them."""
        found = re.match(r"this pair: sampled by weights v(\d+) · latest weights v(\d+)", text(".wb-version"))
        assert found, text(".wb-version")
        return int(found[1]), int(found[2])

    def on_show():
        assert widget.locator(".wb-pair").is_visible()
        return versions()

    ARTIFACTS.mkdir(exist_ok=True)
    widget.focus()
    latest_at_press = []
    ready = lambda: int((re.search(r"queue: (\d+) pairs ready", text(".wb-status")) or [0, 0])[1])  # noqa: E731
    for n in range(12):
        eventually(on_show, timeout=300, what="a pair on show")
        if n == 3:  # the fourth label starts an update: have the fifth pair ready, to label while it trains
            until(lambda: ready() >= 1, timeout=300, what=lambda: f"a pair ready: {text('.wb-status')!r}")
        if n == 4:  # the fourth label started an update: press while it trains
            until(lambda: "an update is training now" in text(".wb-updates"), timeout=60,
                  what=lambda: f"an update training; the widget says {text('.wb-count')!r} {text('.wb-live')!r} {text('.wb-message')!r}")
            widget.screenshot(path=str(ARTIFACTS / "labeler-live-updating.png"))
            assert "an update is training now" in text(".wb-updates")
        a, b = text(".wb-a"), text(".wb-b")
        latest_at_press.append(versions()[1])
        before = page.evaluate("() => document.activeElement.closest('.wb-lab') !== null")
        assert before, "the labeler lost the keyboard focus"
        last = text(".wb-last")  # "<pair id>: <choice>" of the latest label (a hidden repeat adds no pair to the count)
        page.keyboard.press("t" if len(a) == len(b) else "1" if len(a) < len(b) else "2")
        until(lambda: text(".wb-last") != last, timeout=30, what="the key taken")
    until(lambda: updates_done() == 3 and "an update is training now" not in text(".wb-updates"), timeout=300,
          what=lambda: f"3 updates; the widget says {text('.wb-count')!r} {text('.wb-live')!r} {text('.wb-message')!r}")

    records = [json.loads(line) for line in (lab["home"] / "runs" / "preference-live-labels.jsonl").read_text().splitlines()]
    labels = [r for r in records if r["type"] == "label"]
    assert len(labels) == 12 and all(r["choice"] in ("A", "B", "tie") for r in labels), labels
    # The pairs follow the weights (a hidden repeat shows an earlier pair again: not counted here).
    fresh = [(r["policy_version"], latest) for r, latest in zip(labels, latest_at_press) if not r.get("repeat_of")]
    shown = [version for version, _ in fresh]
    assert shown == sorted(shown) and shown[0] == 0 and shown[-1] >= 1, shown
    after_first = [version for version, latest in fresh if latest >= 1]
    assert after_first and after_first.count(0) <= 1, (shown, latest_at_press)  # at most the pair on show then
    for record in labels:  # what the person picked is what was recorded (the shorter one, in characters)
        if record["choice"] != "tie":
            assert len(record["chosen"]) < len(record["rejected"]), record

    # The held-out margin, as plotted and as the widget's own chart, rose with the updates.
    def gains() -> list[float]:
        (plot,) = [p for p in plots(page) if p["title"] == "held-out margin gain"]
        assert plot["traces"][0]["steps"] == [1, 2, 3], plot
        return plot["traces"][0]["y"]
    gain = eventually(gains, timeout=30)
    assert gain[-1] > gain[0] and gain[-1] > 0, gain
    assert widget.locator(".wb-chart .wb-point").count() == 4  # update 0 (the start) to 3
    assert text(".wb-chart .wb-last-gain") == f"{'+' if gain[-1] >= 0 else ''}{gain[-1]:.2f}"  # its latest value, written
    bars = {r.get_attribute("data-choice"): int(r.text_content().split()[-1]) for r in widget.locator(".wb-count-row").all()}
    assert sum(bars.values()) == 12 and set(bars) <= {"A", "B", "tie"}, bars  # a bar per judgment, every label counted
    widget.screenshot(path=str(ARTIFACTS / "labeler-live-3-updates.png"))

    # An edit: the person rewrites answer A; "edited beats the original" trains at once (update 4).
    eventually(on_show, timeout=300, what="a pair on show")
    original = text(".wb-a")
    widget.focus()
    page.keyboard.press("e")
    editor = widget.locator(".wb-edit-text")
    assert editor.is_visible() and editor.input_value() == original
    editor.fill("Short and right.")
    editor.press("Control+Enter")
    until(lambda: updates_done() == 4, timeout=300, what="the edit's update")
    # The status line is redrawn a moment after the update count (its own message from the kernel): waited for.
    until(lambda: "update 4 done (an edit" in text(".wb-status"), timeout=30, what=lambda: text(".wb-status"))
    edit = json.loads((lab["home"] / "runs" / "preference-live-labels.jsonl").read_text().splitlines()[-1])
    assert (edit["choice"], edit["chosen"], edit["rejected"]) == ("edit", "Short and right.", original), edit

    # Undo of a label that already fed an update: it says what it cannot undo.
    widget.focus()
    page.keyboard.press("z")
    until(lambda: "update 4 already trained on it and stays" in text(".wb-message"), what="the undo's message")
    assert text(".wb-a") == original  # the edited pair is on show again
    widget.screenshot(path=str(ARTIFACTS / "labeler-live-undo.png"))

    # The summary cell again: what the page says matches the labels file; the export has the pairs.
    counts = run_state(page)["prompts"]
    summary.locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Shift+Enter")
    until(lambda: run_state(page)["prompts"] != counts, timeout=60)

    def printed_again() -> str:  # the cell's output is cleared when it starts, and printed when it ends
        assert "pairs labelled" in outputs.text_content(), outputs.text_content()
        return outputs.text_content()
    printed = eventually(printed_again, timeout=60)
    preferences_in_force = [r for r in labels if r["choice"] in ("A", "B") and not r.get("repeat_of")]
    pairs = len({r["item_id"] for r in labels if not r.get("repeat_of")})
    assert f"{pairs} pairs labelled" in printed and "4 updates, the weights are now v4" in printed, printed
    held = re.search(r"held-out margin gain over the start: ([+-][\d.]+) on 6 pairs", printed)
    assert held and float(held[1]) > 0, printed
    assert f"{len(preferences_in_force)} preference pairs exported" in printed, printed
    exported = [json.loads(line) for line in (lab["home"] / "runs" / "preference-live.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in exported] == \
        [(r["prompt"], r["chosen"], r["rejected"]) for r in preferences_in_force]
    repeats = [r for r in labels if r.get("repeat_of")]
    if repeats:  # a hidden repeat came back swapped; the rule judged it the same way
        assert f"{len(repeats)} of {len(repeats)} repeats agreed" in text(".wb-agreement")

    # The queue full, the loop rests (it samples only up to queue_size ahead): the costs stop moving.
    until(lambda: ready() >= 4 and "sampling more" not in text(".wb-status"), timeout=300,
          what=lambda: f"a full queue: {text('.wb-status')!r}")
    check_notebook(page, lab, "03_preference.ipynb", 4, {LOSS, "held-out margin gain"})
    # The loss plotted is the DPO loss the notebook's function returned (log 2 = 0.69 at the first
    # update, where policy and reference coincide), not the linear surrogate the server sees (about 0).
    (loss,) = [p for p in plots(page) if p["title"] == LOSS]
    assert loss["traces"][0]["y"][0] == pytest.approx(math.log(2), abs=0.01), loss
    (row,) = [s for s in backend_api(lab).get("/api/v1/usage/sessions").json()["sessions"]
              if s["display_name"] == "03_preference.ipynb"]
    assert 0.0 < row["last_loss"] < 1.0, row  # the sidebar's last loss: the DPO loss too


def test_distillation_notebook(lab, browser):
    (page,) = run_notebooks(lab, browser, [("04_distillation.ipynb", {"steps": 2, "prompts_per_step": 2})])
    text = page.locator(".jp-Notebook").text_content()
    assert "kl_teacher:" in text and "student:" in text
    check_notebook(page, lab, "04_distillation.ipynb", 2, {LOSS, "kl_teacher"})


def test_explore_notebook(lab, browser):
    """Fork at a step with another learning rate, overlay the runs with a metric of the notebook's own,
    compare four samplers, probes after each step: every plot has a trace per run, the fork's starting
    at its fork step; the probes' heat map shows the reference's tokens as text; the compare table has
    a column per sampler; the Runs widget and the sidebar show the fork under its parent. Screenshots of
    each piece land in tests/_artifacts/explore-*.png (docs/workbench.md shows them)."""
    steps, fork_step = 4, 2
    (page,) = run_notebooks(lab, browser, [("05_explore.ipynb", {"steps": steps, "fork_step": fork_step})])
    text = page.locator(".jp-Notebook").text_content()
    assert f"'fork_step': {fork_step}" in text, text[-2000:]
    by_title = {p["title"]: p for p in plots(page)}
    traces = {title: {t["name"]: t["steps"] for t in by_title[title]["traces"]} for title in by_title}
    every, after_fork = list(range(1, steps + 1)), list(range(fork_step + 1, steps + 1))
    assert traces[LOSS] == {"lr 1e-3": every, "lr 3e-3": after_fork}, traces
    assert traces["held-out loss per token"] == {"eval_loss · lr 1e-3": every,
                                                 "eval_loss · lr 3e-3": [fork_step, *after_fork]}, traces

    # The probes: a heat map over the reference answer's tokens, as text, and a greedy answer before/after.
    reference = page.locator(".wb-probe[data-index='0']")
    assert reference.locator(".wb-tok").count() >= 3
    assert re.search(r"[A-Za-z]{3}", reference.locator(".wb-tok").first.text_content() +
                     reference.locator(".wb-tok").nth(1).text_content())
    assert page.locator(".wb-probe[data-index='1'] .wb-answer").count() >= 2

    # Compare: one column per sampler.
    heads = page.locator(".wb-compare th.wb-sampler")
    assert [h.get_attribute("data-sampler") for h in heads.all()] == [
        "base model", f"lr 1e-3 step {fork_step}", f"lr 1e-3 step {steps}", f"lr 3e-3 step {steps}"]
    assert page.locator(".wb-compare tr.wb-row").count() == 3

    # The tree, in the Runs widget and in the sidebar.
    runs = page.locator(".wb-runs tr.wb-run")
    assert [(r.locator(".wb-run-name").text_content(), r.get_attribute("data-depth")) for r in runs.all()] == [
        ("lr 1e-3", "0"), ("lr 3e-3", "1")]
    assert runs.nth(1).locator("td").nth(1).text_content() == f"lr 1e-3 @ step {fork_step}"
    assert "last loss (sum)" in page.locator(".wb-runs th").all_text_contents()
    assert re.match(r"The session spent \$\S+: \$\S+ on these runs' training, \$\S+ on the rest \(sampling",
                    page.locator(".wb-runs-note").text_content()), page.locator(".wb-runs-note").text_content()
    open_sidebar(page)
    row = page.locator("li.jp-StepwiseSession[data-name='05_explore.ipynb']")

    def sidebar_tree():
        items = row.locator("li.jp-StepwiseRun")
        assert [i.get_attribute("data-depth") for i in items.all()] == ["0", "1"]
        assert items.nth(1).locator(".jp-StepwiseRun-fork").text_content() == f"from lr 1e-3 @ step {fork_step}"
    eventually(sidebar_tree)

    ARTIFACTS.mkdir(exist_ok=True)
    for piece, selector in (("dashboard", ".wb-dashboard .wb-dashboard-panels, .wb-dashboard"), ("probes", ".wb-probes"),
                            ("runs", ".wb-runs"), ("compare", ".wb-compare"),
                            ("sidebar", "li.jp-StepwiseSession[data-name='05_explore.ipynb']")):
        element = page.locator(selector).first
        element.scroll_into_view_if_needed()
        element.screenshot(path=str(ARTIFACTS / f"explore-{piece}.png"))
    check_notebook(page, lab, "05_explore.ipynb", steps, {LOSS, "held-out loss per token"})


def test_the_labeler_as_a_person_uses_it(lab, browser, tmp_path):
    """The labeler in the page: the "cut off" mark shows beside the answer that hit its token limit
    and not beside the other; pressing 1 labels what is shown as A, and the next pair (both answers
    whole) shows no mark; the progress reads 1 / 2; the label is in the labels file under
    STEPWISE_HOME with the answer that was on the A side."""
    import json

    import nbformat

    cut = "Red, or perhaps the deep shade of"
    labels = lab["home"] / "runs" / "labeler-in-the-page.jsonl"
    source = tmp_path / "labeler-in-the-page.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import workbench\n"
        f"items = [{{'id': 'colour', 'prompt': 'Name a colour.', 'completions': ['Blue.', {cut!r}], 'truncated': [False, True]}},\n"
        "         {'id': 'fruit', 'prompt': 'Name a fruit.', 'completions': ['An apple.', 'A pear.']}]\n"
        f"workbench.Labeler(items, path={str(labels)!r}, seed=0)")]
    nbformat.write(nb, source)
    name = write_notebook(lab, source, {})
    page = browser.new_page()
    try:
        open_notebook(page, lab, name)
        run_all(page)
        wait_until_run([page], lab, timeout=120)
        assert not problems(page), problems(page)
        widget = page.locator(".wb-lab")

        def first_pair():
            assert widget.locator(".wb-prompt").text_content() == "Name a colour."
        eventually(first_pair)
        sides = {side: widget.locator(f".wb-{side}").text_content() for side in "ab"}
        assert set(sides.values()) == {"Blue.", cut}
        for side, text in sides.items():  # the mark sits beside the cut answer only
            assert widget.locator(f".wb-cut-{side}").is_visible() == (text == cut), (side, text)
        ARTIFACTS.mkdir(exist_ok=True)
        widget.screenshot(path=str(ARTIFACTS / "labeler-cut-off.png"))

        widget.focus()
        page.keyboard.press("1")  # A is better

        def next_pair():
            assert widget.locator(".wb-prompt").text_content() == "Name a fruit."
            assert widget.locator(".wb-count").text_content() == "1 / 2"
            assert not widget.locator(".wb-cut-a").is_visible() and not widget.locator(".wb-cut-b").is_visible()
        eventually(next_pair)
        (record,) = [json.loads(line) for line in labels.read_text().splitlines()]
        assert record["item_id"] == "colour" and record["choice"] == "A", record
        assert record["chosen"] == sides["a"], record
    finally:
        page.close()
        (lab["root"] / name).unlink()  # this test's notebook is not the notebooks' output


# The rl insight notebook's parameters in the test: the run that tests/test_rl_insight.py measures (the
# held-out answers collapse onto "I'm sorry for", flagged at step 4 of its 6; the leash keeps the second run
# diverse). The notebook's own default is 8 steps; the first 6 of them hold the collapse with a step to spare.
RL_INSIGHT = {"steps": 6, "learning_rate": 1e-3, "kl_penalty_coef": 1.0, "groups_per_batch": 4, "group_size": 4,
              "max_tokens": 4, "temperature": 0.7, "monitor_prompts": 8}


# Where click_point clicks: a point of a trace (see click_point), in page pixels, and its step.
POINT_JS = """([title, trace]) => {
        const gd = [...document.querySelectorAll('.jp-Notebook .js-plotly-plot')]
            .find(el => ((el.layout.title || {}).text ?? el.layout.title) === title);
        gd.scrollIntoView({block: 'center'});
        const full = gd._fullLayout, box = gd.getBoundingClientRect();
        // the lines shown (marks along the edges are on y2 and y3; a trace hidden from its legend is not shown)
        const shown = gd.data.filter(t => t.visible !== 'legendonly');
        const lines = shown.filter(t => !t.yaxis || t.yaxis === 'y');
        const axis = t => ({y2: full.yaxis2, y3: full.yaxis3})[t.yaxis] || full.yaxis;  // y3: the flags' strip
        const pixel = (t, i) => ({x: box.left + full.xaxis._offset + full.xaxis.l2p(t.x[i]),
                                  y: box.top + axis(t)._offset + axis(t).l2p(t.y[i])});
        const mine = lines.find(t => t.name === trace);
        if (!mine) return {gap: -1, traces: gd.data.map(t => [t.name, t.visible, t.yaxis])};
        let best = null;
        [...mine.x].forEach((step, i) => {
            if (mine.y[i] === null) return;
            const p = pixel(mine, i);
            // the flag and skip marks count too: a reward of 1.0 sits under the flags along the top
            const gap = Math.min(1e9, ...shown.filter(t => t !== mine).map(t => {
                const j = [...t.x].indexOf(step);
                return j < 0 || t.y[j] === null ? 1e9 : Math.abs(pixel(t, j).y - p.y);
            }));
            if (!best || gap > best.gap) best = {...p, step, gap};
        });
        return best;
    }"""


HOVERED_JS = """(title) => {
        const gd = [...document.querySelectorAll('.jp-Notebook .js-plotly-plot')]
            .find(el => ((el.layout.title || {}).text ?? el.layout.title) === title);
        return (gd._hoverdata || []).map(p => [p.data.name, p.x]);
    }"""


def click_point(page, title: str, trace: str) -> int:
    """Click, with the mouse, a point of `trace` in the plot titled `title`: the one farthest from every
    other trace's point (a run's line or a flag's mark) at its step, so the click cannot land on another
    (plotly's own axes say where each is drawn). Returns the step clicked."""
    where = None
    for _ in range(20):  # until the plot stays put: JupyterLab lays out the cells around it as they scroll into view
        before, where = where, page.evaluate(POINT_JS, [title, trace])
        if where["gap"] < 0 or before is not None and abs(before["x"] - where["x"]) < 1 and abs(before["y"] - where["y"]) < 1:
            break
        page.wait_for_timeout(300)
    assert where["gap"] >= 0, where
    if where["gap"] > 12:
        # plotly answers a click with the points its hover found, and computes hover at most every 50 ms after a
        # mouse move (HOVERMINTIME): a click sent at once can find none and open nothing. So click once the hover
        # holds this trace's point at this step, as it does under a person's pointer.
        page.mouse.move(where["x"], where["y"])
        until(lambda: [trace, where["step"]] in page.evaluate(HOVERED_JS, title), timeout=10)
        page.mouse.click(where["x"], where["y"])
        return where["step"]
    # Every point shares its place with another trace's: hide the others (a click on their legend
    # entries, as a person does, slower than plotly's double click: two clicks on an entry within
    # 300 ms would show that entry alone), click, and show them again.
    plot = page.locator(".jp-Notebook .js-plotly-plot").filter(has=page.locator(".gtitle", has_text=title)).first
    others = [e for e in plot.locator(".legend .traces").all() if e.locator(".legendtext").text_content() != trace]
    for entry in others:
        toggle_legend_entry(page, title, entry, hidden=True)
    step = click_point(page, title, trace) if others else None
    assert step is not None, f"no point of {trace} in {title} can be clicked on its own"
    for entry in others:
        toggle_legend_entry(page, title, entry, hidden=False)
    return step


HIDDEN_JS = """([title, name]) => {
        const gd = [...document.querySelectorAll('.jp-Notebook .js-plotly-plot')]
            .find(el => ((el.layout.title || {}).text ?? el.layout.title) === title);
        return gd.data.filter(t => t.name === name).every(t => t.visible === 'legendonly');
    }"""


def toggle_legend_entry(page, title: str, entry, hidden: bool) -> None:
    """Click a legend entry of the plot titled `title`, and wait until plotly has hidden (or shown) its trace.
    plotly waits out its double-click time (300 ms) before it acts on a single click, so once the trace has
    changed the next click on the legend cannot be read as the second click of a double click (which would
    show that entry alone)."""
    name = entry.locator(".legendtext").text_content()
    entry.locator(".legendtoggle").click()
    until(lambda: page.evaluate(HIDDEN_JS, [title, name]) == hidden, timeout=10,
          what=f"the trace {name!r} of {title!r} {'hidden' if hidden else 'shown'} by a click on its legend entry")


def test_rl_insight_notebook(lab, browser):
    """A custom task whose reward the model games (exactly three words), run without and then with the
    KL leash, on one dashboard: every plot has each run's trace at every step; run 1's collapse is
    flagged in words and marked on the plots; a click on a point of run 1's reward opens that step's
    groups in the inspector (its run and step in the page, the step's triage in words, the tied groups
    marked), ◀ goes to the step before, "this prompt across steps" follows one prompt; nothing breaks
    after a reload.
    Screenshots: tests/_artifacts/rl-insight-*.png."""
    steps = RL_INSIGHT["steps"]
    (page,) = run_notebooks(lab, browser, [("06_rl_insight.ipynb", RL_INSIGHT)])
    text = page.locator(".jp-Notebook").text_content()
    assert "I'm sorry for" in text and "reward 1.0" in text and "reward 0.0" in text  # the reward, tried
    assert re.search(r"step \d+: collapse: ", text), text[-3000:]  # run 1 printed its flagged steps

    by_title = {p["title"]: p for p in plots(page)}
    panels = {LOSS, "reward", "group outcomes", "distinct answers", "KL to the base"}
    assert set(by_title) == panels, by_title.keys()
    runs = ("no leash", f"leash {RL_INSIGHT['kl_penalty_coef']:g}")
    every = list(range(1, steps + 1))
    traces = {t["name"]: t["steps"] for t in by_title["reward"]["traces"]}
    assert all(traces[f"reward · {run}"] == every for run in runs), traces
    skipped = {s for marked in skip_marks(by_title[LOSS]).values() for s in marked}  # a step of either run that tied
    losses = {t["name"]: t["steps"] for t in by_title[LOSS]["traces"] if t["name"] in runs}
    assert set(losses) == set(runs) and all(set(steps) | skipped == set(every) for steps in losses.values()), losses
    flagged = traces["flag: collapse"]
    assert flagged and all(p["traces"][-1]["name"].startswith("flag: ") for p in by_title.values())
    for plot in by_title.values():  # the flag marks sit above the lines, never on a point of one
        points = drawn_points(page)[plot["title"]]
        marks = [box for name, boxes in points.items() if name.startswith("flag: ") for box in boxes]
        lines = [box for name, boxes in points.items() if not name.startswith(("flag: ", "skipped (")) for box in boxes]
        assert marks and lines and not any(overlapping(m, p) for m in marks for p in lines), plot["title"]
        assert plot["legend"] == len(plot["traces"]) and not plot["legend_cut"], (plot["title"], plot["legend"])
    hover_inside(page, "reward", "flag: collapse")
    alerts = page.locator(".wb-flag[data-kind='collapse']")
    assert alerts.count() >= 1 and "of no leash · collapse: " in alerts.first.text_content()
    detail = alerts.first.text_content()
    assert "held-out answers" in detail and ("identical" in detail or "distinct of 8" in detail), detail
    # The acceptance run: without the leash the policy collapses (and games the reward); with it, it never does,
    # stays more varied than the collapse bound and nearer the base model.
    assert not any(f"of {runs[1]} · collapse" in a for a in alerts.all_text_contents())
    y = {t["name"]: t["y"] for plot in by_title.values() for t in plot["traces"]}
    free_collapse = min(i for i, v in enumerate(y[f"probe_distinct · {runs[0]}"]) if v <= 0.25)  # rl.Config.collapse_distinct
    assert max(y[f"reward · {runs[0]}"][free_collapse:]) > y[f"reward · {runs[0]}"][0]
    assert min(y[f"probe_distinct · {runs[1]}"]) > 0.25
    assert max(y[f"kl_policy_base · {runs[1]}"]) < max(y[f"kl_policy_base · {runs[0]}"])

    # A click on run 1's reward at step 2 opens step 2 of run 1 below the plots.
    assert "Click a point" in page.locator(".wb-plot-clicks").text_content()
    inspector = page.locator(".wb-rollouts")
    step = click_point(page, "reward", "reward · no leash")  # once: it clicks on a point the hover holds

    def shows_step(step: int):
        assert inspector.get_attribute("data-step") == str(step)
        assert inspector.locator(".wb-label").text_content() == "no leash"
        summary = inspector.locator(".wb-summary").text_content()
        assert summary.startswith(f"step {step}: {RL_INSIGHT['groups_per_batch']} groups, "), summary
        assert f"{RL_INSIGHT['monitor_prompts']} held-out probe answers" in summary
        rows = inspector.locator("tr[data-index]")
        assert rows.count() == RL_INSIGHT["groups_per_batch"] * RL_INSIGHT["group_size"] + RL_INSIGHT["monitor_prompts"]
        tied = int(re.search(r"(\d+) tied", summary)[1])
        assert inspector.locator("tr.wb-tied").count() >= tied * RL_INSIGHT["group_size"]
    eventually(lambda: shows_step(step))
    ARTIFACTS.mkdir(exist_ok=True)
    inspector.screenshot(path=str(ARTIFACTS / "rl-insight-step.png"))
    inspector.locator(".wb-prev" if step > 1 else ".wb-next").click()
    eventually(lambda: shows_step(step - 1 if step > 1 else 2))
    inspector.locator("tr[data-index]").last.click()  # a held-out probe: its prompt is asked at every step
    inspector.locator(".wb-across").click()

    def across():
        summary = inspector.locator(".wb-summary").text_content()
        found = re.search(rf"at {steps} steps: (\d+) answers", summary)
        assert found and int(found[1]) >= steps, summary
        assert inspector.get_attribute("data-step") == ""  # one prompt, no one step
    eventually(across)
    size = page.viewport_size  # the dashboard is taller than a screen: the notebook's own scrolling would cut it
    page.set_viewport_size({"width": size["width"], "height": 2200})
    dashboard = page.locator(".wb-dashboard").first
    dashboard.scroll_into_view_if_needed()
    dashboard.screenshot(path=str(ARTIFACTS / "rl-insight-dashboard.png"))
    page.set_viewport_size(size)
    check_notebook(page, lab, "06_rl_insight.ipynb", steps, panels)


def theme_colour(page, variable: str) -> str:
    """A JupyterLab theme colour as the browser computes it (e.g. "rgb(245, 124, 0)")."""
    return page.evaluate("""(variable) => {
        const probe = document.createElement('div');
        probe.style.background = `var(${variable})`;
        document.body.append(probe);
        const colour = getComputedStyle(probe).backgroundColor;
        probe.remove();
        return colour;
    }""", variable)


def budget_marks(page, notebook: str) -> dict:
    """The budget as the status bar and the notebook's sidebar row show it: state, classes, colours, texts."""
    return page.evaluate("""(notebook) => {
        const status = document.querySelector('.jp-StepwiseCost');
        const row = document.querySelector(`li.jp-StepwiseSession[data-name='${notebook}'] > .jp-StepwiseBudget`);
        return {state: status.dataset.budgetState, classes: [...status.classList].filter(c => c.startsWith('stepwise-budget')),
                background: getComputedStyle(status).backgroundColor, title: status.title,
                sidebar: row && !row.hidden ? {state: row.dataset.state, classes: [...row.classList].filter(c => c.startsWith('stepwise-budget')),
                                               text: row.querySelector('.jp-StepwiseBudget-text').textContent,
                                               bar: getComputedStyle(row.querySelector('.jp-StepwiseBudget-bar')).backgroundColor} : null};
    }""", notebook)


def test_budget_notebook(lab, browser):
    """A session with a budget of 5 steps (at $3.36e-6 a step), run until the backend refuses, then raised:
    while the cells run, the status bar turns amber (stepwise-budget-warning, the theme's warn colour) at
    80% and red (stepwise-budget-exhausted, its error colour) once refused, its tooltip naming the session's
    budget, and the sidebar's budget bar with it; the meters frozen at those moments show the bar in those
    colours with the text the notebook printed; the live meter ends as the usage API's budget reads; the
    loss plotted against cost has a point per step, at the run's cumulative cost (the last at the run's
    cost). Screenshots: tests/_artifacts/budget-*.png."""
    name = "07_budget.ipynb"
    write_notebook(lab, NOTEBOOKS / name, {"budget_usd": 0.00002, "more_steps": 2, "pause_s": 3.0})
    page = browser.new_page()
    open_notebook(page, lab, name)
    open_sidebar(page)  # its budget bar is watched too
    run_all(page)
    ARTIFACTS.mkdir(exist_ok=True)
    seen: dict[str, dict] = {}  # state -> the first look at it while the cells ran
    deadline = time.monotonic() + 600
    while True:
        marks = budget_marks(page, name)
        if marks["state"] in ("warning", "exhausted") and marks["state"] not in seen:
            seen[marks["state"]] = marks
            page.screenshot(path=str(ARTIFACTS / f"budget-status-{marks['state']}.png"))
        state = run_state(page)
        if state["cells"] and state["done"] == state["cells"] or problems(page):
            break
        assert time.monotonic() < deadline, f"the notebook did not finish: {state}"
        page.wait_for_timeout(200)
    assert not problems(page), problems(page)
    text = page.locator(".jp-Notebook").text_content()
    usage = session_of(lab, name)
    api = backend_api(lab)
    budget = api.get("/api/v1/usage", params={"session_id": usage["id"], "limit": 1}).json()["budget"]

    # The status bar and the sidebar at 80% and at 100%, in the theme's colours.
    colours = {"warning": theme_colour(page, "--jp-warn-color1"), "exhausted": theme_colour(page, "--jp-error-color1")}
    assert set(seen) == {"warning", "exhausted"}, seen
    for state, marks in seen.items():
        assert marks["classes"] == [f"stepwise-budget-{state}"] and marks["background"] == colours[state], marks
        assert marks["title"].startswith(f"Budget of session {usage['id']}: $0.0000"), marks
        assert ("nearly spent" if state == "warning" else "the backend refuses more work") in marks["title"], marks
        sidebar = marks["sidebar"]
        assert sidebar and sidebar["classes"] == [f"stepwise-budget-{state}"] and sidebar["bar"] == colours[state], marks
    assert re.match(r"\$0\.0000\d\d of \$0\.000020 \((8\d|9\d)%\)$", seen["warning"]["sidebar"]["text"]), seen

    # The meters: live, as it stood at 80%, as it stood when refused.
    live, nearly, spent = page.locator(".wb-cost").all()
    printed = re.search(r"after (\d+) steps: (\$\S+ of \$\S+ \(\d+%\)), warning", text)
    refused = re.search(r"refused after (\d+) steps: .*over budget: the budget of session (\S+) is", text)
    assert printed and refused and refused[1] == printed[1] and refused[2] == usage["id"], text[-3000:]
    refusal = text[refused.start():].split("send it again")[0]  # the printed message, in words, not a dict
    assert "'detail'" not in refusal and not re.search(r"\$[\d.,]*e[-+]", refusal), refusal
    for meter, state, words in ((nearly, "warning", printed[2]), (spent, "exhausted", printed[2])):
        bar = meter.locator(".wb-budget")
        assert bar.get_attribute("data-state") == state and f"wb-budget-{state}" in bar.get_attribute("class")
        assert bar.locator(".wb-budget-text").text_content() == words  # nothing was billed for the refused call
        assert bar.locator(".wb-budget-bar").evaluate("e => getComputedStyle(e).backgroundColor") == colours[state]
        width = bar.locator(".wb-budget-bar").evaluate("e => e.getBoundingClientRect().width / e.parentElement.getBoundingClientRect().width")
        assert 0.8 <= width <= 1.0, width
    assert "set_budget(usd=...) raises it" in spent.locator(".wb-budget-note").text_content()
    assert budget["state"] == "ok" and budget["budget_usd"] == pytest.approx(0.0001), budget
    eventually(lambda: live.locator(".wb-budget-text").text_content() == budget_text(budget))
    assert live.locator(".wb-budget").get_attribute("data-state") == "ok"
    nearly.scroll_into_view_if_needed()
    nearly.screenshot(path=str(ARTIFACTS / "budget-meter-warning.png"))
    spent.screenshot(path=str(ARTIFACTS / "budget-meter-exhausted.png"))

    # The loss against cost: a point per step (five before the refusal, two after), at the run's cost by then.
    steps = int(refused[1]) + 2
    assert re.search(rf"\b{steps} steps, ", text), text[-2000:]
    (plot,) = page.evaluate("""() => [...document.querySelectorAll('.jp-Notebook .wb-dashboard .js-plotly-plot')].map(el => ({
        x: el.layout.xaxis.title.text, traces: el.data.map(t => ({name: t.name, x: [...t.x], steps: [...t.customdata]}))}))""")
    (loss,) = plot["traces"]
    assert plot["x"] == "$" and loss["steps"] == list(range(1, steps + 1)), plot
    assert all(a < b for a, b in zip(loss["x"], loss["x"][1:])), loss["x"]
    run_cost = api.get("/api/v1/usage", params={"training_run_id": f"{usage['id']}:train:0", "limit": 1}).json()["totals"]["cost"]
    assert loss["x"][-1] == pytest.approx(run_cost, rel=1e-9) and usage["cost"] == pytest.approx(run_cost, rel=1e-9)
    page.locator(".wb-dashboard").first.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "notebook-07_budget.png"))


AGENT = {"sft_steps": 2, "steps": 4, "groups_per_batch": 4, "group_size": 4, "eval_prompts": 8, "eval_samples": 4, "max_turns": 2}


def test_agent_tools_notebook(lab, browser):
    """Multi-turn tool use, as notebook 08 teaches it: the base model never calls the calculator; two steps of
    SFT on whole demonstrated episodes; then RL on episodes (call, the calculator's answer, the reply) under a
    strict reward (a plain answer with the product, after a call that ran) raises the held-out reward, and the
    rewarded episodes answer in words: almost none echoes the tool's reply or carries its markup (read from the
    stored rollouts, not from the reward). The plots show the reward, its three grades and the tool calls and
    turns per episode at every step; the cost per episode is printed; the inspector shows an episode turn by
    turn, the calculator's turns in grey boxes with no token coloured and the policy's tokens coloured by
    logprob, and the grades as columns. Screenshots: tests/_artifacts/agent-*.png."""
    name = "08_agent_tools.ipynb"
    (page,) = run_notebooks(lab, browser, [(name, AGENT)])
    text = "\n".join(page.locator(".jp-Notebook .jp-OutputArea-output").all_text_contents())  # outputs, not sources
    assert "Error: ZeroDivisionError: division by zero" in text and "Error: NameError" in text  # the tool's errors
    assert "'37 times 48 is 1776.': reward 1.0" in text and "'1776': reward 0.0" in text  # the strict reward, shown
    base = re.findall(r"What is \d+\*\d+\? -> reward (\S+), (\d+) tool calls", text)
    assert len(base) == 4 and all(calls == "0" for _, calls in base), base  # the base model never calls it
    losses = [float(x) for x in re.findall(r"step \d: loss per assistant token (\S+)", text)]
    assert len(losses) == AGENT["sft_steps"] and losses[-1] < losses[0] / 2, losses
    before, after = map(float, re.search(r"held-out reward: (\S+) -> (\S+)", text).groups())
    # By script at these sizes (the notebook's cells, 2026-12-05): seed 0 0.34 -> 0.69, seed 1 0.25 -> 0.78. With three
    # warm-up steps the model starts near the top (0.75-0.88 -> 0.94-1.00), with one it never answers (0.0 -> 0.0).
    assert after >= before + 0.15, (before, after)
    per_episode = re.search(r"(\d+) episodes, \$(\S+): \$(\S+) per episode", text)
    played = AGENT["steps"] * AGENT["groups_per_batch"] * AGENT["group_size"] + 2 * AGENT["eval_prompts"] * AGENT["eval_samples"]
    assert per_episode and int(per_episode[1]) == played, text[-2000:]
    assert float(per_episode[3]) == pytest.approx(float(per_episode[2]) / played, rel=1e-2)
    echoes(Path(re.search(r"rollouts: (\S+\.rollouts)", text)[1]))

    by_title = {p["title"]: p for p in plots(page)}
    every = list(range(1, AGENT["steps"] + 1))
    traces = {t["name"]: t["steps"] for t in by_title["per episode"]["traces"]}
    assert traces["tool_calls"] == traces["turns"] == traces["tool_errors"] == every, traces
    assert {t["name"]: t["steps"] for t in by_title["reward"]["traces"]}["reward"] == every
    assert {t["name"]: t["steps"] for t in by_title["grades"]["traces"]} == {g: every for g in ("answer", "tool_use", "format")}
    assert "steps flagged by rl insight: none" in text  # a rewarded answer never echoes: rl insight has nothing to flag

    # The last cell's inspector: the best episode, turn by turn.
    inspector = page.locator(".wb-rollouts").last
    inspector.locator("tr[data-index]").first.click()
    observation = inspector.locator('[data-role="observation"]')
    eventually(lambda: observation.count() >= 1)
    assert "<tool_response>" in observation.first.text_content()
    headers = inspector.locator("th").all_text_contents()
    assert {"answer", "tool_use", "format"} <= {h.strip(" ▲▼") for h in headers}, headers
    assert observation.first.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(238, 241, 244)"
    assert observation.locator(".wb-tok").count() == 0  # no logprob, no advantage: nothing coloured
    shades = inspector.locator('[data-role="policy"] .wb-tok').evaluate_all(
        "spans => spans.map(s => getComputedStyle(s).backgroundColor)")
    assert shades and any(c != "rgba(0, 0, 0, 0)" for c in shades)
    ARTIFACTS.mkdir(exist_ok=True)
    inspector.scroll_into_view_if_needed()
    inspector.screenshot(path=str(ARTIFACTS / "agent-episode.png"))
    check_notebook(page, lab, name, AGENT["steps"], {LOSS, "reward", "grades", "per episode"})


def echoes(rollouts: Path) -> None:
    """Of the rewarded training episodes a run stored, the share whose final answer carries tool markup or is a tool's
    reply copied back must be under 10% (read from the tokens and their roles, independently of the reward)."""
    from workbench.recipes import common
    from workbench.recipes.rollout_log import RolloutLog

    tokenizer, log = common.local_tokenizer(), RolloutLog(rollouts)
    rewarded, echoed = 0, []
    for step in log.steps():
        for row in log.samples(step, kind="train"):
            if row["reward"] <= 0:
                continue
            roles, tokens = row["roles"], row["tokens"]
            last = max(i for i, role in enumerate(roles) if role == "observation")  # the tool's turn
            tool = tokenizer.decode(tokens[:last + 1], skip_special_tokens=True).rsplit("<tool_response>", 1)[1]
            answer = tokenizer.decode(tokens[last + 1:], skip_special_tokens=True).strip()
            rewarded += 1
            if "<tool" in answer or "</tool" in answer or answer == tool.split("</tool_response>")[0].strip():
                echoed.append(answer)
    assert rewarded and len(echoed) < 0.1 * rewarded, (rewarded, echoed[:5])


# ---- reloading a finished run while another thread makes widgets (issue 56) ---------------------------

RELOADED = "reload-finished-run.ipynb"


@pytest.fixture
def tiny_backend(tmp_path, stepwise_home, tiny_model):
    """A backend of this test's own on the tiny stand-in model (tests/tiny_model.py): what is checked is
    what the page shows, not what the model learns."""
    from servers import start_server
    from tiny_model import stand_in_env

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(stepwise_home / "models")
    server = start_server(home, env=stand_in_env(tiny_model), timeout=600)
    yield server
    server.stop()


def finished_run_widgets(page) -> dict:
    """What the page draws of the finished run's widgets: dashboards, full progress bars (tqdm's: a box of
    its label, a bar and '3/3 ...'), cost meters; and whether any widget is still "Loading widget..."."""
    bars = page.locator(".jp-OutputArea-output .widget-hbox").filter(has=page.locator(".widget-hprogress"))
    return {"dashboards": page.locator(".wb-dashboard").count(), "meters": page.locator(".wb-cost").count(),
            "bars": [b.text_content() for b in bars.all()],
            "loading": "Loading widget" in page.locator(".jp-Notebook").text_content()}


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"  # an output that shows a widget (by its model id)


@contextlib.contextmanager
def widget_traffic(page, shown_ids: list[str]):
    """`with widget_traffic(page, ids) as heard:` a list that fills with what the page's widget manager sends and hears on the kernel's websocket (the
    requests for the kernel's widgets and their answers, seconds after the list was cleared) and the
    page's console errors: evidence for a failure's message. `shown_ids`: the model ids the saved notebook's outputs
    show; an answer that lacks one, or a comm_close of one, is noted (which side lost a widget). The page's
    listeners go on the way out, so that a test reloading many times does not pile them up."""
    heard: list = []
    start = [time.monotonic()]

    def note(*what):
        if not heard:
            start[0] = time.monotonic()
        heard.append((round(time.monotonic() - start[0], 2), *what))

    def on_websocket(socket):
        def frame(payload, direction):
            text = payload if isinstance(payload, str) else payload.decode("utf-8", "replace")
            for key in ("request_states", "update_states", "comm_info_request", "comm_info_reply"):
                if key in text:
                    lacks = [i[:8] for i in shown_ids if i not in text] if key in ("update_states", "comm_info_reply") else []
                    note(direction, key, len(text), *([f"lacks shown widgets {lacks}"] if lacks else []))
            if "comm_close" in text and any(i in text for i in shown_ids):
                note(direction, "comm_close of a shown widget", [i[:8] for i in shown_ids if i in text])
        socket.on("framesent", lambda payload: frame(payload, "sent"))
        socket.on("framereceived", lambda payload: frame(payload, "heard"))
    def on_console(message):
        if message.type == "error":
            note("console", message.text[:300])

    page.on("websocket", on_websocket)
    page.on("console", on_console)
    try:
        yield heard
    finally:
        page.remove_listener("websocket", on_websocket)
        page.remove_listener("console", on_console)


def test_a_finished_runs_widgets_come_back_on_every_reload(lab, browser, tiny_backend):
    """A finished SFT run's widgets (its progress bar, the dashboard's plots, a cost meter) while another
    thread in the kernel keeps making and closing progress bars (as a second run's would): the page is
    reloaded five times and each time every widget is drawn again, none "Loading widget..." or "Error
    displaying widget: model not found". Before workbench/client/widget_states.py the kernel's answer to the
    reloaded page's request for its widgets raised when that thread made or closed one meanwhile, and
    the page got no answer (tests/test_workbench_widgets.py reproduces that race deterministically; here it
    shows only sometimes). What is left, on a busy machine, is ipywidgets' own renderer giving up on a model the
    kernel's answer held (reload_and_wait: proven from the websocket, then reloaded once more)
    (tests/_artifacts/notebook-reload-finished-run.png)."""
    import httpx
    import nbformat

    endpoint = f"base_url={tiny_backend.base_url!r}, api_key={tiny_backend.api_key!r}"
    cells = [f"import threading, ipywidgets, workbench\nfrom workbench.recipes import common, sft\n"
             f"client = workbench.connect({endpoint}, progress=False)\n"
             f"config = sft.Config({endpoint}, steps=3, eval_every=1, save_every=3, sample_questions=1)",
             'dashboard = workbench.Dashboard(session=client, panels={"loss per assistant token": ["train_loss", "eval_loss"]})\n'
             "display(dashboard)\n"
             'summary = await workbench.in_thread(sft.run, config, service_client=client, '
             'on_step=common.plot_to(dashboard, "eval_loss", "train_loss"))',
             "workbench.CostMeter(session=client)",
             "stop = threading.Event()\n\n"
             "def progress_bars():  # another run's bars, made and closed every 20 ms until the kernel ends\n"
             "    while not stop.wait(0.02):\n"
             '        bar = ipywidgets.HBox([ipywidgets.HTML("eval"), ipywidgets.FloatProgress(), ipywidgets.HTML("1/3")])\n'
             "        for widget in (bar, *bar.children):  # each with its layout and style, or they pile up in the kernel\n"
             "            for part in (widget, widget.layout, getattr(widget, 'style', None)):\n"
             "                part and part.close()\n\n"
             "threading.Thread(target=progress_bars, daemon=True).start()"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab["root"] / RELOADED)
    try:
        page = browser.new_page()
        open_notebook(page, lab, RELOADED)
        run_all(page)
        wait_until_run([page], lab)
        assert not problems(page), problems(page)
        shown = plots(page)
        assert {p["title"] for p in shown} == {LOSS, "loss per assistant token"}, shown
        drawn = finished_run_widgets(page)
        assert drawn["dashboards"] == drawn["meters"] == len(drawn["bars"]) == 1 and not drawn["loading"], drawn
        assert "3/3" in drawn["bars"][0], drawn
        save(page)
        assert len(shown_widgets(lab["root"] / RELOADED)) >= 3  # the bar, the dashboard, the cost meter
        for reload in range(1, 6):
            def every_widget_back():
                assert not problems(page), problems(page)
                assert finished_run_widgets(page) == drawn
                assert plots(page) == shown
            reload_and_wait(page, lab["root"] / RELOADED, every_widget_back, f"reload {reload}")
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(".wb-dashboard").first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "notebook-reload-finished-run.png"))
    finally:
        # The kernel shuts down (its thread of progress bars with it), as closing the notebook does.
        for session in httpx.get(f"{lab['url']}/api/sessions").json():
            if session["path"] == RELOADED:
                httpx.delete(f"{lab['url']}/api/sessions/{session['id']}")
        (lab["root"] / RELOADED).unlink()
