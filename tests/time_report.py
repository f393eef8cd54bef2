"""Where `make test`'s time went: install, each test file, the slowest tests (read from pytest's JUnit XML).

`make test` writes the install's seconds and one XML per pytest run into .test-report/ and prints this at the
end. Run it by hand on the same folder: `python tests/time_report.py .test-report [--slowest 25]`.

A test's time is its setup, call and teardown (pytest's JUnit `time`), so a session fixture's start-up counts
in the first test that used it. With xdist the files run side by side: their times add up to more than the
wall clock, which the report prints too.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def read_runs(folder: Path) -> list[tuple[str, float, list[tuple[str, str, float, str]]]]:
    """[(run name, wall seconds, [(file, test name, seconds, outcome)])] for each JUnit XML in `folder`."""
    runs = []
    for path in sorted(folder.glob("*.xml")):
        suite = ET.parse(path).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        tests = []
        for case in suite.iter("testcase"):
            file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            tests.append((file, case.get("name", ""), float(case.get("time") or 0), outcome))
        runs.append((path.stem, float(suite.get("time") or 0), tests))
    return runs


def report(folder: Path, slowest: int = 25) -> str:
    install = folder / "install-seconds"
    lines = ["", "== where the time went (tests/time_report.py) =="]
    if install.exists():
        lines.append(f"install (make install chromium): {float(install.read_text()):7.0f} s")
    runs = read_runs(folder)
    per_file: dict[str, float] = collections.Counter()
    everything = []
    outcomes: dict[str, int] = collections.Counter()
    for name, wall, tests in runs:
        lines.append(f"pytest run {name!r}: {wall:7.0f} s wall, {sum(t[2] for t in tests):7.0f} s of test time, "
                     f"{len(tests)} tests")
        for file, test, seconds, outcome in tests:
            per_file[f"{file} [{name}]" if name != "main" else file] += seconds
            everything.append((seconds, f"{file}::{test}" + (f" [{name}]" if name != "main" else "")))
            outcomes[outcome] += 1
    lines.append("\ntest time per file:")
    lines += [f"{seconds:7.1f} s  {file}" for file, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])]
    lines.append(f"\nthe {slowest} slowest tests (setup + call + teardown):")
    lines += [f"{seconds:7.1f} s  {test}" for seconds, test in sorted(everything, reverse=True)[:slowest]]
    # Both runs together, in the plain closing line CI reads.
    failed = outcomes["failure"] + outcomes["error"]
    lines.append(f"\ntotal: {outcomes['passed']} passed, {failed} failed, {outcomes['skipped']} skipped")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--slowest", type=int, default=25)
    args = parser.parse_args()
    print(report(args.folder, args.slowest))
