"""Old public names that still resolve, with a ``DeprecationWarning``, for one release.

A package that renamed a public name keeps a table of them and a module ``__getattr__`` built
here::

    __getattr__ = renamed_attributes(__name__, globals(), {"Mode": "EditMode"})

``from package import Mode`` then warns naming the new name and gives the very same object; an
unknown name still raises ``AttributeError``. docs/contributing.md has the rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any


def renamed_attributes(module: str, namespace: dict[str, Any], renamed: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each old name in ``renamed`` to its new name."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated: use {module}.{new}", DeprecationWarning, stacklevel=2)
        return namespace[new]

    return __getattr__
