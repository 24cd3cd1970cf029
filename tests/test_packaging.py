"""The install extras as a user meets them: ``pip install trio-disagg`` is the core library
alone, and the command line names the extra it needs (docs/design.md, Dependencies)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: What the ``server`` and ``demo`` extras add; none of it comes with the core install.
SERVER_STACK = ("hypercorn", "httpx", "httptools", "prometheus_client", "openai")
#: The examples that need nothing but the core (04 runs the in-process mock engines).
CORE_EXAMPLES = ("01_request_nursery.py", "02_transfer_keeper.py", "03_gatekeeper.py",
                 "04_router.py")

#: Run in a fresh interpreter: which of the server stack did importing the library load?
LOADED = textwrap.dedent(f"""
    import sys
    import trio_disagg, trio_disagg.engines
    from trio_disagg.engines import mock_cluster
    stack = {SERVER_STACK!r}
    print(sorted({{m.partition(".")[0] for m in sys.modules}} & set(stack)))
""")


def _run(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False,
                          cwd=cwd)


def test_importing_the_library_loads_no_server_stack() -> None:
    """Even where the extras are installed, ``import trio_disagg`` (and the in-process
    mock engines) load none of the HTTP stack: a trio service pays only for the core."""
    done = _run([sys.executable, "-c", LOADED])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built as a release would build it."""
    dist = tmp_path_factory.mktemp("dist")
    uv = shutil.which("uv")
    if uv is not None:
        built = _run([uv, "build", "--wheel", "--out-dir", str(dist), str(ROOT)])
    else:
        built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir",
                      str(dist), str(ROOT)])
    if built.returncode != 0:
        pytest.skip(f"cannot build the wheel here: {built.stderr.strip()[-300:]}")
    (found,) = dist.glob("trio_disagg-*.whl")
    return found


def _fresh_venv(work: Path, requirement: str) -> Path:
    """A fresh virtual environment with ``requirement`` installed; its python."""
    uv = shutil.which("uv")
    venv.create(work, with_pip=uv is None)
    python = work / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if uv is not None:  # uv installs from its cache: seconds instead of pip's half minute
        install = [uv, "pip", "install", "--python", str(python), requirement]
    else:
        install = [str(python), "-m", "pip", "install", "--quiet", requirement]
    installed = _run(install)
    if installed.returncode != 0:
        pytest.skip(f"cannot install the wheel's dependencies (offline?): "
                    f"{installed.stderr.strip()[-300:]}")
    return python


@pytest.fixture(scope="module")
def core_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the project's wheel installed, no extras."""
    return _fresh_venv(tmp_path_factory.mktemp("core-install"), str(wheel))


def test_core_install_has_no_server_stack(core_venv: Path) -> None:
    """``pip install trio-disagg`` brings trio, attrs, cattrs, trio-util and orjson only."""
    probe = "import importlib.util as u; print([m for m in %r if u.find_spec(m)])"
    done = _run([str(core_venv), "-c", probe % (SERVER_STACK,)], cwd=core_venv.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    done = _run([str(core_venv), "-c", LOADED], cwd=core_venv.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("example", CORE_EXAMPLES)
def test_core_install_runs_the_core_examples(core_venv: Path, example: str) -> None:
    done = _run([str(core_venv), str(ROOT / "examples" / example)], cwd=core_venv.parent)
    assert done.returncode == 0, done.stdout + done.stderr


def _script(venv_python: Path) -> Path:
    return venv_python.parent / ("trio-disagg.exe" if os.name == "nt" else "trio-disagg")


@pytest.mark.parametrize(("command", "extra"), [
    (["serve"], "server"), (["mock-worker", "--role", "prefill"], "server"),
    (["demo"], "demo"),  # the demo extra installs the server extra too
])
def test_command_without_its_extra_names_it(
    core_venv: Path, command: list[str], extra: str
) -> None:
    """The command line without its extra: one line naming the extra to install, exit 2."""
    done = _run([str(_script(core_venv)), *command], cwd=core_venv.parent)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"pip install 'trio-disagg[{extra}]'" in done.stderr


def test_core_install_answers_version_and_help_naming_the_extras(core_venv: Path) -> None:
    """``--version`` and ``--help`` (the commands' too) need no extra; the help says which
    extra each command needs, and how to install it."""
    script = str(_script(core_venv))
    done = _run([script, "--version"], cwd=core_venv.parent)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.startswith("trio-disagg ")
    done = _run([script, "--help"], cwd=core_venv.parent)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps the lines
    assert ("serve and mock-worker need the 'server' extra (not installed: pip install "
            "'trio-disagg[server]')") in text
    assert "demo needs the 'demo' extra (not installed: pip install 'trio-disagg[demo]')" in text
    for command, flag in (("serve", "--prefill URL"), ("mock-worker", "--role"),
                          ("demo", "--requests")):
        done = _run([script, command, "--help"], cwd=core_venv.parent)
        assert (done.returncode, done.stderr) == (0, ""), (command, done.stderr)
        assert flag in done.stdout and "not installed" in " ".join(done.stdout.split())


def test_core_install_says_which_extra_the_server_needs(core_venv: Path) -> None:
    """Importing the HTTP parts of the library without the extra fails with its name."""
    for module in ("trio_disagg.server", "trio_disagg.workers"):
        done = _run([str(core_venv), "-c", f"import {module}"], cwd=core_venv.parent)
        assert done.returncode == 1
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("ModuleNotFoundError: "), done.stderr
        assert f"{module} needs the 'server' extra" in last
        assert "pip install 'trio-disagg[server]'" in last
    done = _run([str(core_venv), "-c", "from trio_disagg.engines import VllmEngine"],
                cwd=core_venv.parent)
    assert "trio_disagg.engines.VllmEngine needs the 'server' extra" in done.stderr


def test_server_extra_serves_and_the_demo_names_its_own_extra(
    wheel: Path, tmp_path: Path
) -> None:
    """``trio-disagg[server]`` is enough for the router and the mock workers; the demo,
    which drives them with the openai client, asks for ``trio-disagg[demo]``."""
    python = _fresh_venv(tmp_path / "venv", f"{wheel}[server]")
    done = _run([str(python), "-c", "import trio_disagg.server, trio_disagg.workers; "
                 "from trio_disagg.engines import VllmEngine"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = _run([str(python), "-m", "trio_disagg", "serve", "--help"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--prefill URL" in done.stdout and "not installed" not in " ".join(done.stdout.split())
    done = _run([str(python), "-m", "trio_disagg", "demo"], cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "pip install 'trio-disagg[demo]'" in done.stderr
