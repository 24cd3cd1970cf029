"""Every tutorial in examples/ runs, exits 0 and prints what it promises; so do the
Python snippets of the docs pages that make a whole program, or a whole engine.

Each example lists the text it must print in comment lines ``# expect: <text>``. An example
that cannot run here (it needs a network or runs for long) opts out with a line
``# test-examples: skip <reason>``; the skip is then reported with its reason.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_disagg as td

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


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.DOTALL)


def test_router_page_driving_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/router.md, "Driving it": a whole program, its loop body made to print."""
    block = python_blocks("router.md")[0]
    assert "trio.run(main)" in block and "...  # tokens" in block
    block = block.replace("...  # tokens", "print(item.data.finish_reason)  # tokens")
    exec(compile(block, "docs/router.md", "exec"), {"__name__": "__main__"})
    finishes = capsys.readouterr().out.splitlines()
    assert len(finishes) == 16 and finishes[:-1] == ["None"] * 15
    assert finishes[-1] == "length"


def test_howto_engine_snippets_make_engines_the_router_drives() -> None:
    """docs/howto-engine.md, "Write an engine": its two shapes with its two ``generate``
    methods plugged in serve a request, and leave the "KV" dict empty."""
    namespaces: list[dict[str, Any]] = [{"td": td, "trio": trio} for _ in range(3)]
    shapes, prefill_generate, decode_generate = namespaces
    shape, prefill_shape, prefill_body, decode_body = python_blocks("howto-engine.md")
    exec(shape + prefill_shape, shapes)
    exec(prefill_body, prefill_generate)
    exec(decode_body, decode_generate)
    kv: dict[str, object] = {}
    prefill, decode = shapes["MyPrefill"](), shapes["MyDecode"]()
    shapes["MyPrefill"].generate = prefill_generate["generate"]
    shapes["MyDecode"].generate = decode_generate["generate"]
    prefill.kv = decode.kv = kv

    async def main() -> list[td.Annotated[td.LLMEngineOutput]]:
        async with td.TransferKeeper() as keeper:
            router = td.DisaggRouter(td.WorkerPool([prefill]), td.WorkerPool([decode]),
                                     keeper)
            request = td.PreprocessedRequest(request_id="r1", model="m", max_tokens=3,
                                             body={"prompt": "hello"})
            async with trio.open_nursery() as nursery:
                stream = await router.stream(nursery, request, td.RequestContext("r1"))
                with stream.outputs:
                    items = [item async for item in stream.outputs]
        return items

    items = trio.run(main)
    assert [item.data.token_ids for item in items if item.data] == [[0], [1], [2]]
    assert items[-1].data is not None and items[-1].data.finish_reason is not None
    assert kv == {}  # the decode pulled what the prefill staged
