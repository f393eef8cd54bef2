"""docs/workbench.md as a newcomer reads it: its Python snippets, top to bottom, run as one script
against the local backend of the test session's STEPWISE_HOME (tinker_server, found by connect()).
That backend serves the tiny random stand-in for the default model (tests/tiny_model.py): the page must
run as printed, and none of its snippets checks what a model learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from servers import REPO


def test_the_workbench_api_page_runs_as_printed(tinker_server, stepwise_home):
    page = (REPO / "docs" / "workbench.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(snippets) >= 8  # connect, Dashboard, CostMeter, inspector, labeler, snapshot, recipes, a task
    script = "\n".join(snippets) + "\nprint('DOCS-OK')\n"
    env = {**os.environ, "STEPWISE_HOME": str(stepwise_home)}
    env.pop("STEPWISE_BASE_URL", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "DOCS-OK" in done.stdout, (done.stdout + done.stderr)[-4000:]
