"""The project carries its own rules: every document it cites is in the repository, and
every rule of docs/semantics.md is named by at least one test and one docs page."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Rules that no code implements yet, each with the open work that will: a rule leaves
#: this list as soon as a test names it (the last test below fails otherwise).
NOT_YET_IMPLEMENTED: dict[str, str] = {}


def tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).suffix in {".py", ".md", ".toml"}]


def rule_ids() -> list[str]:
    text = (ROOT / "docs" / "semantics.md").read_text()
    return re.findall(r"^\(rule-([CSTGB]\d+)\)=", text, flags=re.MULTILINE)


def names(rule: str, text: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9]){rule}(?![0-9])", text) is not None


def test_every_cited_document_is_in_the_repository() -> None:
    present = {path.relative_to(ROOT).as_posix() for path in tracked_files()}
    missing: list[str] = []
    for path in tracked_files():
        text = path.read_text(errors="replace")
        for notes in re.findall(r"\b(?:SEMANTICS|PROTOCOLS|DESIGN)\.md\b", text):
            missing.append(f"{path.relative_to(ROOT)} cites {notes}")
        for cited in re.findall(r"\bdocs/[\w.-]+\.md\b", text):
            if cited not in present:
                missing.append(f"{path.relative_to(ROOT)} cites {cited}")
    assert not missing, "\n".join(missing)


def test_every_rule_is_named_by_a_test_and_a_docs_page() -> None:
    rules = rule_ids()
    assert len(rules) == 40 and rules[0] == "C1" and rules[-1] == "B10"
    tests = "\n".join(path.read_text() for path in (ROOT / "tests").glob("test_*.py")
                      if path.name != "test_reference.py")
    docs = "\n".join(path.read_text() for path in (ROOT / "docs").glob("*.md")
                     if path.name != "semantics.md")
    untested = [rule for rule in rules if not names(rule, tests)]
    undocumented = [rule for rule in rules if not names(rule, docs)]
    assert untested == sorted(NOT_YET_IMPLEMENTED), untested
    assert set(undocumented) <= set(NOT_YET_IMPLEMENTED), undocumented


def test_every_rule_opens_with_its_incident_or_says_there_is_none() -> None:
    """docs/semantics.md opens each rule with the public incident behind it, or says, in
    the rule's own section or its group's introduction, that none stands behind it."""
    text = (ROOT / "docs" / "semantics.md").read_text()
    silent = []
    for group in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        intro, *sections = re.split(r"^### ", group, flags=re.MULTILINE)
        for section in sections:
            says_none = "no public incident" in section or "no single public incident" in intro
            if "**Incident.**" not in section and not says_none:
                silent.append(section.splitlines()[0])
    assert not silent, silent


def test_every_exported_constant_and_alias_is_in_the_api_reference() -> None:
    """docs/reference.md documents what each public package exports. ``automodule``
    documents the classes and functions a package imports, but not its constants and
    type aliases (it would need their comment in the ``__init__``), so each of those has
    an ``autodata`` of its own (docs/conf.py finds its comment where it is defined)."""
    import importlib
    import inspect

    from trio_disagg import mock

    reference = (ROOT / "docs" / "reference.md").read_text()
    missing = []
    for package in ("trio_disagg", "trio_disagg.engines", "trio_disagg.server",
                    "trio_disagg.mock"):
        module = importlib.import_module(package)
        for name in dir(module):
            value = getattr(module, name)
            if name.startswith("_") or inspect.ismodule(value):
                continue
            if inspect.isclass(value) or inspect.isroutine(value):
                continue  # automodule documents these
            if package == "trio_disagg.engines" and hasattr(mock, name):
                continue  # an old alias of the simulator's name, documented there
            if f".. autodata:: {package}.{name}\n" not in reference:
                missing.append(f"{package}.{name}")
    assert not missing, missing


def test_an_attributes_comment_is_rendered_as_written() -> None:
    """Once: napoleon read the words before the first colon of an attribute's ``#:``
    comment as its type, so the reference showed ``HandoffState.STAGED`` as "the prefill
    answered), and no decode took it yet. Type: KV is staged (sequential styles", and
    did the same to some 40 other public attributes and enum members."""
    import importlib.util

    from sphinx.ext.napoleon.docstring import GoogleDocstring

    spec = importlib.util.spec_from_file_location("docs_conf", ROOT / "docs" / "conf.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)

    class App:
        def connect(self, event: str, handler: object) -> None:
            pass

    conf.setup(App())
    comment = ["KV is staged (sequential styles: the prefill answered), and no decode",
               "took it yet."]
    lines = GoogleDocstring(comment, what="attribute", name="STAGED").lines()
    assert [line for line in lines if line] == comment
