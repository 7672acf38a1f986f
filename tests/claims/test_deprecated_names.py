"""Names ``sidecar.claims`` renamed stay for one release as aliases that warn (DeprecationWarning
naming the new name) and return the new object."""

from __future__ import annotations

import pytest

import sidecar.claims as claims
from sidecar.claims import AdmissionVerdict, ProtectionMode


@pytest.mark.parametrize(("old", "new"), [("Mode", ProtectionMode), ("Admission", AdmissionVerdict),
                                          ("ActiveAdmission", AdmissionVerdict)])
def test_old_names_warn_and_are_the_new_objects(old: str, new: type) -> None:
    with pytest.warns(DeprecationWarning, match=rf"sidecar\.claims\.{old} is deprecated: use sidecar\.claims\.{new.__name__}"):
        got = getattr(claims, old)
    assert got is new
    assert old not in claims.__all__


def test_from_import_of_an_old_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="ProtectionMode"):
        from sidecar.claims import Mode
    assert Mode.HARD_PROTECTED is ProtectionMode.HARD_PROTECTED


def test_unknown_names_still_fail() -> None:
    with pytest.raises(AttributeError, match="NoSuchName"):
        claims.NoSuchName  # noqa: B018
