"""The JupyterLab extension's TypeScript checks, run from pytest so that `make test` runs them:
the type check of every source (tsc) and the jest unit tests of the formatting and the data model
(extension/src/__tests__). jlpm comes from the jupyter-builder package; Node from the system.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from servers import REPO

EXTENSION = REPO / "extension"
BIN = Path(sys.executable).parent  # jlpm and jupyter-builder live beside this Python


@pytest.fixture(scope="module")
def jlpm():
    if shutil.which("node") is None:
        pytest.skip("the TypeScript tests need Node (`apt-get install nodejs`)")
    if not (BIN / "jlpm").exists():
        pytest.skip("the TypeScript tests need jlpm: pip install jupyter-builder (`make install` does)")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}

    def run(*args: str, timeout: float = 300) -> str:
        result = subprocess.run([str(BIN / "jlpm"), *args], cwd=EXTENSION, env=env, capture_output=True,
                                text=True, timeout=timeout)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"jlpm {' '.join(args)} failed:\n{output[-6000:]}"
        return output

    if not (EXTENSION / "node_modules").exists():
        run("install")  # from the committed yarn.lock
    return run


def test_every_source_type_checks(jlpm):
    jlpm("tsc", "--noEmit")


def test_jest_unit_tests_pass(jlpm):
    output = jlpm("jest", "--ci")
    counts = re.search(r"Tests:\s+(?:(\d+) failed, )?(\d+) passed, (\d+) total", output)
    assert counts and not counts.group(1) and counts.group(2) == counts.group(3), output[-3000:]
    assert int(counts.group(3)) >= 10  # the suites were found and ran
