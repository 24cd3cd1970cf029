"""Sphinx configuration: MyST Markdown pages, autodoc reference, the bundled alabaster theme.

Build with ``uv run sphinx-build -W -q -b html docs docs/_build/html`` (CI runs exactly
that: every warning is an error).
"""

from __future__ import annotations

import sys
from pathlib import Path

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
# _p3_section.md: a section of performance.md, to be pasted in there (not a page).
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "_p3_section.md"]

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
