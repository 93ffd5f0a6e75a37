"""The ``fsdp-sync`` command and the tools only it uses.

Holds the command (`app.main`: ``demo | bench | plan | serve | faults | soak``), its argument checks
(`args`), the demo, the benchmarks (`bench/`), the fault matrix, the soak, the plots, the local
launcher (`launch.run_ranks`) and the tiny trainer the demo and benchmarks train with.

Not here: anything the library needs. Nothing outside this package imports it; it may import the
whole library. ``rich`` and ``matplotlib`` are needed here only.
"""

from .app import main

__all__ = ["main"]
