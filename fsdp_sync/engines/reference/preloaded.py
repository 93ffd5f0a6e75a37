"""Imported last by a forkserver (`procs.PRELOAD`, `cli.launch.PRELOAD`): freezes what the server
imported before it forks a child, as ``gc.freeze``'s documentation advises for fork without exec.

A server that imported torch (and transformers, for rank jobs) otherwise spends 1.5 s of a core
when it exits, its interpreter's last collections walking every object of those imports, and
holds its parent's stdout open meanwhile (a caller that reads the output to its end waits for
it). Frozen, its exit takes a fraction of that, and the children it forks never write to the
gc headers of those objects (each collection in a child would have). Nothing else: the children
collect their own garbage as usual.

Not here: starting the server (`procs`, `cli.launch`)."""

from __future__ import annotations

import gc

gc.collect()   # the imports' garbage goes first: frozen, it would stay for good
gc.freeze()
