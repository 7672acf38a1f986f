"""``clients.transformers.pretrained`` moved to ``sidecar.models``; the old path stays for one
release as an alias that warns (DeprecationWarning naming the new name) and is the new module."""

from __future__ import annotations

import importlib
import sys

import pytest

import clients.transformers as ct
import sidecar.models

_OLD = "clients.transformers.pretrained"
_WARNING = r"clients\.transformers\.pretrained is deprecated.*sidecar\.models"


@pytest.fixture(autouse=True)
def _fresh():
    """Each test starts as a process that never touched the old path."""
    ct.__dict__.pop("pretrained", None)
    sys.modules.pop(_OLD, None)
    yield
    ct.__dict__.pop("pretrained", None)
    sys.modules.pop(_OLD, None)


def test_the_attribute_warns_and_is_sidecar_models():
    with pytest.warns(DeprecationWarning, match=_WARNING):
        mod = ct.pretrained
    assert mod is sidecar.models
    assert "pretrained" not in ct.__all__


def test_importing_the_old_module_warns_and_gives_sidecar_models():
    with pytest.warns(DeprecationWarning, match=_WARNING):
        from clients.transformers.pretrained import hf_directory, load_tokenizer
    assert hf_directory is sidecar.models.hf_directory and load_tokenizer is sidecar.models.load_tokenizer
    assert sys.modules[_OLD] is sidecar.models
    assert importlib.import_module(_OLD) is sidecar.models


def test_unknown_names_still_fail():
    with pytest.raises(AttributeError, match="no_such_name"):
        ct.no_such_name  # noqa: B018
