"""``fsdp-sync bench``: the sync benchmarks (JSON rows) and what only they use.

`main` holds the command, the per-rank job and the report; `methods` the per-method rows (tensor,
distributed, disk and their floors), `verify` the verify-cost rows, `common` what those share (the
device sampler, the timed sync, the layout figures).

Not here: the library's own timing (`fsdp_sync.memory.Timeline`, the transports' `SyncStats`).
"""
