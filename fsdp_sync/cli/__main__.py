"""``python -m fsdp_sync.cli``: the ``fsdp-sync`` command."""

import gc
import sys

from .app import main

rc = main()
gc.freeze()   # the interpreter's exit then skips walking torch's and transformers' objects (1.5 s)
sys.exit(rc)
