"""The trainer side of a sync: from an FSDP module's shards to the buffers an engine opens.

- `export`: FSDP1 / FSDP2 / plain module -> a lazy stream of named full (or per-rank) tensors.
- `bucket`: the pure planner (tensors -> byte-aligned buckets) and flatten / unflatten.
- `handles`: the only code that knows torch's shareable-tensor handle tuples.
- `layout`: HF tensor -> engine parameter + per-TP-rank slice, per model family.
- `reshard`: each trainer rank cuts its engine TP rank's slices out of its FSDP shards.
- `hf_checkpoint`: the versioned safetensors checkpoint format (the disk method).

Not here: how buckets travel (`fsdp_sync.transport`), the wire form they travel in
(`fsdp_sync.wire`), or anything an engine does with them (`fsdp_sync.engines`).
"""
