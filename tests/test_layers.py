"""The package's layers, read from its source (docs/design.md): no module imports a private
module of another package, the real engines import nothing from the simulator, and the
simulator's files stay small."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "trio_disagg"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path: Path) -> str:
    """The package a module belongs to (for an ``__init__``, the package itself)."""
    return ".".join(path.relative_to(SRC).parent.parts)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, absolute module name)`` of every module ``path`` imports from (the module
    of ``from m import x``, and ``m.x`` when ``x`` is a module of the project)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _package_of(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                target = SRC.joinpath(*candidate.split("."))
                if target.with_suffix(".py").exists() or (target / "__init__.py").exists():
                    yield node.lineno, candidate


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_imports_a_private_module_of_another_package() -> None:
    # A private module (``_x``) is its package's own: a module of that package (or of one
    # of its subpackages) may import it; any other imports the package's public names.
    offences = []
    for path in _sources():
        importer = _module_name(path)
        for line, module in _imports(path):
            if not module.startswith("trio_disagg"):
                continue
            parts = module.split(".")
            for i, part in enumerate(parts):
                if not part.startswith("_"):
                    continue
                owner = ".".join(parts[:i])  # the package the private module belongs to
                if not (importer == owner or importer.startswith(owner + ".")):
                    offences.append(f"{path.relative_to(SRC)}:{line} imports {module}")
                break
    assert not offences, "\n".join(offences)


def test_the_real_engines_import_nothing_from_the_simulator() -> None:
    # The old names (``trio_disagg.engines.mock_cluster``, ...) are aliases resolved on
    # first use by the package's ``__getattr__``; type checkers see them under
    # ``TYPE_CHECKING``. Nothing else of engines/ names the simulator.
    offences = [
        f"{path.relative_to(SRC)}:{line} imports {module}"
        for path in sorted((PACKAGE / "engines").rglob("*.py"))
        for line, module in _imports(path)
        if module == "trio_disagg.mock" or module.startswith("trio_disagg.mock.")
        if not _in_alias_block(path, line)
    ]
    assert not offences, "\n".join(offences)
    # ... so importing the real adapters does not import the simulator.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, trio_disagg.engines; "
                               "print('trio_disagg.mock' in sys.modules)"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert loaded == "False"


def _in_alias_block(path: Path, line: int) -> bool:
    """Whether ``line`` is under ``if TYPE_CHECKING:`` or in a package's ``__getattr__``."""
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        alias = ((isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"))
                 or (path.name == "__init__.py" and isinstance(node, ast.FunctionDef)
                     and node.name == "__getattr__"))
        if alias and node.lineno <= line <= (node.end_lineno or node.lineno):
            return True
    return False


def test_every_module_is_small_pieces() -> None:
    # No file of the package over 500 lines, no function over 60 (its signature and
    # docstring included): each module reads on its own.
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if (lines := len(text.splitlines())) > 500:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 60:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


def test_old_import_paths_still_work() -> None:
    import trio_disagg.engines as engines
    import trio_disagg.mock as mock
    import trio_disagg.workers as workers

    assert engines.mock_cluster is mock.mock_cluster
    assert engines.FaultKind is mock.FaultKind
    assert workers.serve_mock_worker is mock.serve_mock_worker
