"""Deprecated: this module moved to ``sidecar.models``; importing it by its old path warns and
gives ``sidecar.models`` itself. Removed one release after the move."""

import sys
import warnings

import sidecar.models

warnings.warn("clients.transformers.pretrained is deprecated: use sidecar.models", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = sidecar.models
