"""``fsdp-sync bench``: the sync benchmarks (JSON rows) and what only they use.

`main` holds the command, the per-rank job and the report; `methods` the per-method rows (tensor,
distributed, disk and their budgets), `rows` (a row's fields, the rows a failed job keeps), `verify` the verify-cost rows, `lora` the adapter rows;
what those share: `floors` (the floors and the layout figures), `sampling` (the device sampler,
the sampled sync), `allocator` (glibc's mmap threshold pinned in the trainer ranks), `served`
(``--engine http``), `gpu_memory`, `table`, `targets`.

Not here: the library's own timing (`fsdp_sync.memory.Timeline`, the transports' `SyncStats`).
"""
