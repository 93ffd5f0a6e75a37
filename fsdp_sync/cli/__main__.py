"""``python -m fsdp_sync.cli``: the ``fsdp-sync`` command."""

import sys

from .app import main

sys.exit(main())
