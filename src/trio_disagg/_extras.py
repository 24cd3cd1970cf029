"""The install extras, and the clear error a missing one gives.

``pip install trio-disagg`` installs the core library only (trio, attrs, cattrs, trio-util,
orjson). The HTTP router and the mock workers need the ``server`` extra; the demo needs the
``demo`` extra too (the ``openai`` client). docs/design.md explains the split.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping

#: The import names each extra installs.
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("hypercorn", "httpx", "httptools", "prometheus_client"),
    "demo": ("openai",),
}
#: The extras each extra installs too (``trio-disagg[demo]`` is ``[server]`` and more).
INCLUDES: dict[str, tuple[str, ...]] = {"server": (), "demo": ("server",)}


def extra_for(module: str | None) -> str | None:
    """The extra that installs ``module`` (a dotted import name), or None if no extra does."""
    root = (module or "").partition(".")[0]
    for extra, modules in EXTRAS.items():
        if root in modules:
            return extra
    return None


def install_hint(extra: str) -> str:
    """What to run to install ``extra``."""
    return f"pip install 'trio-disagg[{extra}]'"


def missing(extra: str) -> str | None:
    """The first import name of ``extra`` (or of an extra it includes) that is not
    installed, or None if the extra is (checked without importing anything)."""
    for included in INCLUDES[extra]:
        module = missing(included)
        if module is not None:
            return module
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            return module
    return None


def require(extra: str, what: str) -> None:
    """Check that the ``extra``'s packages are installed, without importing them.

    Args:
        extra: ``"server"`` or ``"demo"``.
        what: who needs it, for the message (e.g. ``"trio_disagg.server"``).

    Raises:
        ModuleNotFoundError: a package of the extra (or of an extra it includes) is
            missing; its ``name`` is the missing module and its message says which extra
            to install.
    """
    module = missing(extra)
    if module is not None:
        raise ModuleNotFoundError(
            f"{what} needs the '{extra}' extra ({module} is not installed): "
            f"{install_hint(extra)}",
            name=module,
        )


def lazy_attribute(package: str, lazy: Mapping[str, str], name: str, extra: str) -> object:
    """A package's name imported on first use from its module ``lazy[name]`` (a
    package's ``__getattr__``), after checking that ``extra`` is installed; the value is
    then set on the package, so the next lookup does not come here.

    Raises:
        AttributeError: ``name`` is not one of ``lazy``.
        ModuleNotFoundError: the extra is missing (see :func:`require`).
    """
    module = lazy.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    require(extra, f"{package}.{name}")  # a clear error naming the extra
    value = getattr(importlib.import_module(f".{module}", package), name)
    setattr(importlib.import_module(package), name, value)
    return value
