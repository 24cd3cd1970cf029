"""The README's code runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "the README has a python example"
    for block in blocks:
        done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert "finish_reason=FinishReason(kind=<FinishKind.LENGTH" in done.stdout


def test_readme_quick_start_commands() -> None:
    text = README.read_text()
    assert "uv run trio-disagg demo" in text
    assert "uv run pytest" in text
