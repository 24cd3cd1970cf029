"""Sphinx configuration: MyST Markdown pages, autodoc reference, the bundled alabaster theme.

Build with ``uv run sphinx-build -W -q -b html docs docs/_build/html`` (CI runs exactly
that: every warning is an error).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # autodoc imports the package from the source tree

import trio_disagg  # noqa: E402

project = "trio-disagg"
author = "the trio-disagg authors"
copyright = "the trio-disagg authors"
release = trio_disagg.__version__
version = release

# No sphinx.ext.intersphinx: the docs must build without network access.
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: anchors for headings down to ### so pages can link to sections.
myst_heading_anchors = 3

# autodoc / napoleon: the docstrings are Google style.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, not as duplicate attribute entries
napoleon_use_rtype = False

html_theme = "alabaster"
html_title = f"trio-disagg {release}"
html_theme_options = {
    "description": "Disaggregated LLM serving on trio, and its cancellation semantics",
    "fixed_sidebar": True,
}


def _defining_comment(name: str, value: object) -> list[str] | None:
    """The ``#:`` comment above ``name``'s assignment in the module that defines it.

    A package re-exports its constants and type aliases from private modules, where
    their comments are; autodoc looks for a comment in the package's ``__init__`` only,
    and would show the docstring of the value's type (``int``, ``tuple``) instead. The
    package's own modules are searched first, then the rest of ``trio_disagg``.
    """
    from sphinx.errors import PycodeError
    from sphinx.pycode import ModuleAnalyzer

    package, _, attr = name.rpartition(".")
    own = sorted(m for m in sys.modules if m.startswith(package + "."))
    rest = sorted(m for m in sys.modules if m.startswith("trio_disagg.") and m not in own)
    for module_name in own + rest:
        if getattr(sys.modules[module_name], attr, _ABSENT) is not value:
            continue
        try:
            comments = ModuleAnalyzer.for_module(module_name).find_attr_docs()
        except PycodeError:
            continue
        if ("", attr) in comments:
            return list(comments[("", attr)])
    return None


_ABSENT = object()  # no such attribute


def _data_docstring(app: object, what: str, name: str, obj: object, options: object,
                    lines: list[str]) -> None:
    """``autodoc-process-docstring``: a constant's or an alias's own comment."""
    if what == "data" and name.startswith("trio_disagg."):
        comment = _defining_comment(name, obj)
        if comment is not None:
            lines[:] = comment


def _attribute_as_written(self: Any) -> list[str]:
    """An attribute's comment as written. Napoleon would read the words before the first
    colon of its first line as the attribute's type ("KV is staged (sequential styles:
    the prefill answered)"); the annotations in the code give the types."""
    lines = type(self)(self._dedent(self._consume_to_end()), self._config).lines()
    return list(self._format_field("", "", lines))


def setup(app: Any) -> None:
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    GoogleDocstring._parse_attribute_docstring = _attribute_as_written  # type: ignore[method-assign]
    app.connect("autodoc-process-docstring", _data_docstring)
