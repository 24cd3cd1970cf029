"""Every script in benchmarks/ runs with ``--quick`` and exits 0.

Benchmarks print ratios measured side by side; their timings are never asserted here (a
loaded CI machine would make such a test flaky). Every benchmark must accept ``--quick``:
a short run, about a second, that only shows the script still works.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
TIMEOUT = 120


def test_there_are_benchmarks() -> None:
    assert BENCHMARKS, "no benchmarks/*.py found"


@pytest.mark.parametrize("path", BENCHMARKS, ids=[path.name for path in BENCHMARKS])
def test_benchmark_quick(path: Path) -> None:
    try:
        proc = subprocess.run(
            [sys.executable, str(path), "--quick"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{path.name} --quick did not finish within {TIMEOUT} s")
    report = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, f"{path.name} --quick exited {proc.returncode}\n{report}"
    assert proc.stdout.strip(), f"{path.name} --quick printed nothing\n{report}"
