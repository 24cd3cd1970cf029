"""The install extras, and the clear error a missing one gives.

``pip install trio-disagg`` installs the core library only (trio, attrs, cattrs, trio-util,
orjson). The HTTP router and the mock workers need the ``server`` extra; the demo needs the
``demo`` extra too (the ``openai`` client). docs/design.md explains the split.
"""

from __future__ import annotations

import importlib.util

#: The import names each extra installs.
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("hypercorn", "httpx", "httptools", "prometheus_client"),
    "demo": ("openai",),
}


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


def require(extra: str, what: str) -> None:
    """Check that the ``extra``'s packages are installed, without importing them.

    Args:
        extra: ``"server"`` or ``"demo"``.
        what: who needs it, for the message (e.g. ``"trio_disagg.server"``).

    Raises:
        ModuleNotFoundError: a package of the extra is missing; its ``name`` is the missing
            module and its message says which extra to install.
    """
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"{what} needs the '{extra}' extra ({module} is not installed): "
                f"{install_hint(extra)}",
                name=module,
            )
