"""``python -m sidecar.cli``: the ``kv-sidecar`` command."""

import sys

from sidecar.cli.main import main

sys.exit(main())
