"""Every tutorial in examples/ runs, exits 0 and prints what it promises.

Each example lists the text it must print in comment lines ``# expect: <text>``. An example
that cannot run here (it needs a network or runs for long) opts out with a line
``# test-examples: skip <reason>``; the skip is then reported with its reason.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
EXPECT = re.compile(r"^# expect: (.+?)\s*$", re.MULTILINE)
SKIP = re.compile(r"^# test-examples: skip\b(.*)$", re.MULTILINE)
TIMEOUT = 60


def test_there_are_examples() -> None:
    assert EXAMPLES, "no examples/*.py found"


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    if skip := SKIP.search(source):
        pytest.skip(f"{path.name} opts out:{skip.group(1)}")
    expected = EXPECT.findall(source)
    assert expected, f"{path.name} has no '# expect: <text>' line saying what it must print"
    try:
        proc = subprocess.run(
            [sys.executable, str(path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{path.name} did not finish within {TIMEOUT} s")
    report = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}\n{report}"
    missing = [text for text in expected if text not in proc.stdout]
    assert not missing, f"{path.name} did not print {missing}\n{report}"
