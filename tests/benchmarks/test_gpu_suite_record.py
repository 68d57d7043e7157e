"""benchmarks/gpu_tests/README.md's row for the whole GPU suite is what its stored JUnit XML says."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_tests" / "results" / "h200" / "suite"


def test_gpu_suite_row_is_the_stored_junit():
    suite = ET.parse(SUITE / "junit.xml").getroot().find("testsuite")
    tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    row = next(x for x in (ROOT / "benchmarks" / "gpu_tests" / "README.md").read_text().splitlines()
               if x.startswith("| `results/h200/suite/` |"))  # fmt: skip
    said = re.search(r"(\d+) passed, (\d+) skipped .*?, (\d+) failed", row)
    assert said, row
    assert [int(n) for n in said.groups()] == [tests - skipped - failed, skipped, failed]
    assert failed == 0  # the row says the suite passed; a stored failing run may not back it
    summary = (SUITE / "summary.txt").read_text()
    assert f"{tests - skipped - failed} passed, {skipped} skipped" in summary
