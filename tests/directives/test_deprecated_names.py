"""``sidecar.directives.Mode`` was renamed ``EditMode``; the old name stays for one release as
an alias that warns (DeprecationWarning naming the new name) and returns the new object."""

from __future__ import annotations

import pytest

import sidecar.directives as directives
from sidecar.directives import EditMode


def test_mode_warns_and_is_edit_mode():
    with pytest.warns(DeprecationWarning, match=r"sidecar\.directives\.Mode is deprecated.*sidecar\.directives\.EditMode"):
        mode = directives.Mode
    assert mode is EditMode
    with pytest.warns(DeprecationWarning, match="EditMode"):
        from sidecar.directives import Mode
    assert Mode is EditMode
    assert Mode.FORGET is EditMode.FORGET


def test_the_alias_is_not_advertised_and_unknown_names_still_fail():
    assert "Mode" not in directives.__all__
    with pytest.raises(AttributeError, match="NoSuchName"):
        directives.NoSuchName  # noqa: B018
