"""The layout holds: kernel_backend's packages import only the layers below them, workbench's packages likewise
(the client below the recipes, the recipes below the widgets), and no module imports another that (at import time)
imports it back (docs/architecture.md, "The map").

Read from the source with `ast`, nothing imported: module-level imports only (an import inside a function is
lazy, and a `TYPE_CHECKING` block never runs), for kernel_backend/ and workbench/.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The layers, lowest first: a module may import its own layer and those below it. The shared modules are at
# the bottom; the process (the command line, the supervisor, export) at the top, free to import anything.
LAYERS = {"shared": 0, "engine": 1, "persistence": 1, "vllm": 1, "execution": 2, "service": 3, "api": 4, "process": 5}
SHARED = {"config", "errors", "grammars", "types", "metering", "runtime", "tool_calls", "venvs"}
PACKAGES = {"engine", "persistence", "vllm", "execution", "service", "api"}


def modules() -> dict[str, Path]:
    found = {}
    for package in ("kernel_backend", "workbench"):
        for path in (REPO / package).rglob("*.py"):
            found[".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def parse(source: str) -> ast.Module:
    """ast.parse, tried again on a SystemError: once in a clean run CPython 3.11.7 raised "AST constructor recursion
    depth mismatch" for a file that parses (an interpreter bug in its AST constructor's recursion check, not our
    source; not reproduced, and the upstream fix not pinned down)."""
    for attempt in range(3):
        try:
            return ast.parse(source)
        except SystemError:
            if attempt == 2:
                raise


def imports(path: Path, known: dict[str, Path], everywhere: bool = False) -> set[str]:
    """The project's modules `path` imports: at module level, or (everywhere) anywhere in it."""
    tree = parse(path.read_text())
    nodes = ast.walk(tree) if everywhere else (n for n in tree.body if not isinstance(n, ast.If))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name in known}


def layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kernel_backend" or len(parts) == 1:
        return None
    return "shared" if parts[1] in SHARED else parts[1] if parts[1] in PACKAGES else "process"


def test_no_import_runs_up_a_layer():
    known = modules()
    upward = []
    for module, path in known.items():
        here = layer(module)
        if here is None or here == "process":
            continue
        for target in imports(path, known, everywhere=True):  # lazy imports too: a layer is a layer
            there = layer(target)
            if there is not None and there != here and LAYERS[there] >= LAYERS[here]:
                upward.append(f"{module} ({here}) imports {target} ({there})")
    assert not upward, "\n".join(upward)


# What workbench/ may import of kernel_backend (docs/architecture.md, "The map"): the shared modules, the base models'
# names (to read a tokenizer), the losses' table (which losses the RL recipe takes) and the command line.
WORKBENCH_MAY_IMPORT = {"kernel_backend.engine.base_models", "kernel_backend.engine.losses", "kernel_backend.__main__"}


def test_workbench_imports_only_what_the_map_allows():
    known = modules()
    beyond = []
    for module, path in known.items():
        if module.split(".")[0] != "workbench":
            continue
        for target in imports(path, known, everywhere=True):
            if layer(target) not in (None, "shared") and target not in WORKBENCH_MAY_IMPORT:
                beyond.append(f"{module} imports {target}")
    assert not beyond, "\n".join(beyond)


# workbench/'s packages, lowest first (docs/architecture.md, "The map"): the client (reaching a backend), the recipes
# and their training pieces, the widgets that show them. The lab extension's server part sits beside the recipes and
# needs only the client. The top level (workbench/__init__.py, the public API, and cli.py, the `stepwise` command) may
# import anything. A package may import itself and the packages below it, never one beside it.
WORKBENCH_LAYERS = {"client": 0, "recipes": 1, "lab": 1, "widgets": 2}
WORKBENCH_TOP = {"workbench", "workbench.cli"}

# Imports inside a function that run up a layer, each for a reason; any other upward import fails, and so does an
# entry here once its import is gone.
WORKBENCH_LAZY_UPWARD = {
    # connect() turns on the HTML reprs of the SDK's results in a notebook, once connected
    ("workbench.client.connect", "workbench.widgets.reprs"),
    # the recipes' tokenizer is the one the widgets load from this machine's model store
    ("workbench.recipes.common", "workbench.widgets.tokens"),
}


def workbench_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "workbench" or module in WORKBENCH_TOP:
        return None
    return parts[1]


def workbench_upward_imports(known: dict[str, Path]) -> list[tuple[str, str, bool]]:
    """(module, target, lazy) for each import in workbench/ of a package above or beside the module's own."""
    found = []
    for module, path in known.items():
        here = workbench_layer(module)
        if here is None:
            continue
        at_module_level = imports(path, known)
        for target in imports(path, known, everywhere=True):
            there = workbench_layer(target)
            if there is None or there == here or WORKBENCH_LAYERS[there] < WORKBENCH_LAYERS[here]:
                continue
            found.append((module, target, target not in at_module_level))
    return sorted(found)


def test_workbench_packages_import_only_the_layers_below():
    known = modules()
    upward = workbench_upward_imports(known)
    unexplained = [f"{module} ({workbench_layer(module)}) imports {target} ({workbench_layer(target)})"
                   + (" inside a function" if lazy else "")
                   for module, target, lazy in upward if not (lazy and (module, target) in WORKBENCH_LAZY_UPWARD)]
    assert not unexplained, "\n".join(unexplained)
    stale = WORKBENCH_LAZY_UPWARD - {(module, target) for module, target, lazy in upward if lazy}
    assert not stale, f"no longer imported lazily, remove from WORKBENCH_LAZY_UPWARD: {sorted(stale)}"


def test_workbench_top_level_is_only_the_public_api_and_the_command():
    """Everything else lives in a package of the map: a new module at the top is a sign it was not placed."""
    known = modules()
    top = {module for module in known if module.count(".") == 1 and module.split(".")[0] == "workbench"
           and module.split(".")[1] not in WORKBENCH_LAYERS}
    assert top == {"workbench.cli"}, sorted(top)
    assert {module.split(".")[1] for module in known if module.count(".") >= 1 and module.startswith("workbench.")
            } == {*WORKBENCH_LAYERS, "cli"}


def test_no_import_circle():
    known = modules()
    graph = {module: imports(path, known) - {module} for module, path in known.items()}
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not circles, "\n".join(circles)


def test_the_checks_see_the_packages():
    """The checks above are not vacuous: they find the packages, and an upward import where one is planted."""
    known = modules()
    assert {layer(m) for m in known} >= {"shared", "engine", "persistence", "vllm", "execution", "service", "api",
                                        "process"}
    assert "kernel_backend.engine.lora" in imports(known["kernel_backend.engine.core"], known)
    assert LAYERS[layer("kernel_backend.service.core")] > LAYERS[layer("kernel_backend.execution.executor")]
    assert {workbench_layer(m) for m in known} == {None, *WORKBENCH_LAYERS}
    assert "workbench.client.connection" in imports(known["workbench.recipes.common"], known)


def test_the_workbench_check_finds_a_planted_upward_import(tmp_path):
    """A client module that imports a widget at module level, or a recipe that imports one inside a function, is
    reported (and the allowed lazy imports are not)."""
    planted_client = tmp_path / "planted_client.py"
    planted_client.write_text("from workbench.widgets.dashboard import Dashboard\n")
    planted_recipe = tmp_path / "planted_recipe.py"
    planted_recipe.write_text("def show():\n    from workbench.widgets import runs\n")
    known = {**modules(), "workbench.client.planted": planted_client, "workbench.recipes.planted": planted_recipe}
    upward = workbench_upward_imports(known)
    assert ("workbench.client.planted", "workbench.widgets.dashboard", False) in upward
    assert ("workbench.recipes.planted", "workbench.widgets.runs", True) in upward
    assert {(module, target) for module, target, lazy in upward if lazy} >= WORKBENCH_LAZY_UPWARD


def test_every_import_of_our_own_names_resolves():
    """Each `from kernel_backend... import name` / `from workbench... import name` in the project, lazy ones inside
    functions included, names a module that exists and a name it has: a move or a rename that missed a lazy
    import fails here, not on the one code path that reaches it."""
    import importlib

    known = modules()
    files = [*known.values(), *(REPO / "tests").glob("*.py"), *(REPO / "bench").glob("*.py")]
    missing = []
    for path in files:
        for node in ast.walk(parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.split(".")[0] in ("kernel_backend", "workbench")):
                continue
            if node.module.endswith("vllm.worker"):
                continue  # runs in vLLM's venv
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and f"{node.module}.{alias.name}" not in known:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.module} has no {alias.name}")
    assert not missing, "\n".join(missing)


def test_a_widget_s_front_end_is_a_file_of_its_own():
    """Two kinds of widget, one rule each (docs/workbench.md, "Inside the workbench"): one with a front end of its
    own is an anywidget whose `_esm` (and `_css`) is a file beside its module, never JavaScript in a Python
    string; the others (Dashboard, Runs, Compare, Probes) compose ipywidgets and plotly's own renderer, with no
    front end at all. Each class's `_esm`/`_css` assignment is read from the source."""
    fronts = {}
    for name, path in modules().items():
        if not name.startswith("workbench.widgets"):
            continue
        for node in ast.walk(parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = [t.id for t in getattr(item, "targets", []) if isinstance(t, ast.Name)]
                    if {"_esm", "_css"} & set(targets):
                        fronts[f"{name}.{node.name}"] = (path, item.value)
    assert set(fronts) >= {"workbench.widgets.cost.CostMeter", "workbench.widgets.labeler.Labeler",
                           "workbench.widgets.rollouts.RolloutInspector", "workbench.widgets.plot_clicks.PlotClicks"}
    for where, (path, value) in fronts.items():
        # Path(__file__).with_name("name.js"): a call whose one argument is a file's name
        named = (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                 and value.func.attr == "with_name" and isinstance(value.args[0], ast.Constant))
        assert named, f"{where}: its front end is written inline ({ast.unparse(value)[:60]}), not in a file of its own"
        assert path.with_name(value.args[0].value).is_file(), f"{where}: {value.args[0].value} is not beside {path}"
