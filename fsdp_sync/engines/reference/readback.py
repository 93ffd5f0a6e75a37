"""Reading weights back from a reference engine: names and shapes, full tensors gathered from the
TP ranks, checksums and per-rank digests (what `fsdp_sync.verify` compares). A mixin of
`ReferenceEngine`: it asks the workers through the engine's ``_call``.

Every tensor is read back as it is held (`TPLayout.dtype_of`): a block-FP8 engine's quantized
weights as their float8_e4m3fn bytes and their ``weight_scale_inv`` scales (float32) under their own
HF names, so a verify compares the quantized bytes and the scales, not a dequantized copy.

Not here: loading weights (`engine`, `staging`), the digest math (`fsdp_sync.weights.layout`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Iterator, Sequence

import torch

from ...weights.layout import block_of, shard_state_dict
from ..base import checksum_named_tensors

__all__ = ["WeightReadback", "piece_digest", "REPLICA_MISMATCH"]

REPLICA_MISMATCH = "replica mismatch"   # how a `tensor_checksums` note (not a digest) begins


def piece_digest(t: torch.Tensor) -> str:
    """sha256 of one piece's size and bytes, as a worker holds it (a replica's check)."""
    t = t.detach()
    t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
    h = hashlib.sha256(f"{t.numel()}|{t.element_size()}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()

_PIECE_BATCH_BYTES = 64 * 2**20       # full tensors gathered per request by weights_checksum


class WeightReadback:
    """`ReferenceEngine`'s read-back methods (it provides ``_call``, ``layout``, ``tp_size``)."""

    def hf_names(self) -> list[str]:
        """Hugging Face parameter names in ``named_parameters()`` order (tied lm_head excluded)."""
        return self.layout.hf_names()

    def engine_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The engine's own parameter names and per-rank shapes (what ``load_format="direct"`` takes)."""
        return self.layout.engine_shapes()

    def shard_for_rank(self, named: Any, rank: int) -> dict[str, torch.Tensor]:
        """Full HF tensors → rank ``rank``'s tensors in this engine's own layout (for ``"direct"``)."""
        return shard_state_dict(named, self.layout, rank)

    def _gather(self, names: list[str]) -> dict[str, torch.Tensor]:
        return self._gather_checked(names, replicas=False)[0]

    def _gather_checked(self, names: list[str], replicas: bool = True
                        ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The full tensors of ``names`` from the owners' pieces and, with ``replicas``, a note
        for each tensor a rank holds a copy of (a replica: norms, kv heads shared by ranks) that
        differs from the owner's, ``{name: "TP rank r's replica of ... differs ..."}``: each worker
        sends the digest of the pieces it holds but does not own, compared here with the same
        block of the owners' tensor (a full tensor shows the owner's copy only)."""
        replies = self._call("pieces", {"names": names, "replicas": replicas}, what="get_weights_by_name")
        if replicas:
            reps = {r: replies[r][1] for r in replies}
            replies = {r: replies[r][0] for r in replies}
        out, wrong = {}, {}
        for name in names:
            shape = self.layout.full_shape(name)
            full = torch.empty(shape, dtype=self.layout.dtype_of(name, self.dtype))
            for r in range(self.tp_size):
                for src, piece in replies[r][name]:
                    # float8 pieces come as their bytes (see `worker.Worker.pieces`)
                    full[src] = piece.view(full.dtype) if piece.dtype != full.dtype else piece
            out[name] = full
            for r in range(self.tp_size) if replicas else ():
                for src, digest in reps[r].get(name, ()):
                    if piece_digest(full[src]) != digest:
                        wrong[name] = (f"{REPLICA_MISMATCH}: TP rank {r}'s replica of {name!r} "
                                       f"(block {block_of(src, shape)}) differs from its owner's")
                        break
                if name in wrong:
                    break
        return out, wrong

    def rank_pieces(self, name: str) -> dict[int, list[tuple[Any, torch.Tensor]]]:
        """What each TP rank holds of HF tensor ``name``, replicas included: ``{rank: [(src
        slices, tensor), ...]}`` (a verify that found a rank's digest off reads that rank's own
        copy; `get_weights_by_name` shows the owners' copy only)."""
        if not self.layout.accepts(name):
            raise KeyError(f"unknown parameter {name!r}; this model's HF names are e.g. "
                           f"{self.hf_names()[:3]}")
        replies = self._call("pieces", {"names": [name], "every": True}, what="rank_pieces")
        dtype = self.layout.dtype_of(name, self.dtype)
        return {r: [(src, p.view(dtype) if p.dtype != dtype and p.element_size() == dtype.itemsize
                     else p) for src, p in replies[r][name]] for r in range(self.tp_size)}

    def _nbytes(self, name: str) -> int:
        return math.prod(self.layout.full_shape(name)) * self.layout.dtype_of(name, None, self.dtype.itemsize)

    def get_weights_by_name(self, name: str, truncate_size: int | None = None) -> torch.Tensor:
        """The full (CPU) tensor of HF parameter ``name``, assembled from every rank's shard, in the
        dtype it is held in (block FP8: ``float8_e4m3fn`` weights, float32 ``..._scale_inv``)."""
        if not self.layout.accepts(name):
            raise KeyError(f"unknown parameter {name!r}; this model's HF names are e.g. "
                           f"{self.hf_names()[:3]}")
        t = self._gather([name])[name]
        return t if truncate_size is None else t[:truncate_size]

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full tensor in HF order, gathered a batch (about 64 MiB) at a time."""
        batch, size = [], 0
        for name in self.hf_names():
            batch.append(name)
            size += self._nbytes(name)
            if size >= _PIECE_BATCH_BYTES:
                yield from self._gather(batch).items()
                batch, size = [], 0
        if batch:
            yield from self._gather(batch).items()

    def weights_checksum(self) -> str:
        """`checksum_named_tensors` over every full tensor: equals the trainer's
        ``checksum_named_tensors(export.iter_params(model))`` when the weights are the same."""
        return checksum_named_tensors(self.named_full_tensors())

    def tensor_checksums(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """``{name: checksum_named_tensors([(name, full tensor)])}`` for HF ``names`` (None: all),
        assembled from the workers' shards a batch (about 64 MiB) at a time: what
        ``SyncConfig.verify`` compares with the trainer's own. Every rank's copy counts: where a
        rank holds a replica that differs from the owner's piece, the entry is a note beginning
        `REPLICA_MISMATCH` naming the rank (it equals no digest), not the owners' digest."""
        names = self.hf_names() if names is None else list(names)
        bad = [n for n in names if not self.layout.accepts(n)]
        if bad:
            raise KeyError(f"unknown parameter(s) {bad[:3]}; this model's HF names are e.g. "
                           f"{self.hf_names()[:3]}")
        out: dict[str, str] = {}
        batch, size = [], 0
        for i, name in enumerate(names):
            batch.append(name)
            size += self._nbytes(name)
            if size >= _PIECE_BATCH_BYTES or i == len(names) - 1:
                full, wrong = self._gather_checked(batch)
                for n, t in full.items():       # a wrong replica: a note no digest can equal
                    out[n] = wrong.get(n) or checksum_named_tensors([(n, t)])
                batch, size = [], 0
        return out

    def rank_digests(self, names: Sequence[str] | None = None) -> dict[str, list[str]]:
        """``{name: [digest of TP rank 0, 1, ...]}`` for HF ``names`` (None: all): each worker
        hashes the pieces of each tensor it serves (`layout.rank_digest`), so only the digests
        leave the workers. ``SyncConfig.verify`` recomputes them from the trainer's full tensors
        with ``self.layout``; far cheaper than `tensor_checksums`, which ships every full tensor."""
        names = self.hf_names() if names is None else list(names)
        bad = [n for n in names if not self.layout.accepts(n)]
        if bad:
            raise KeyError(f"unknown parameter(s) {bad[:3]}; this model's HF names are e.g. "
                           f"{self.hf_names()[:3]}")
        replies = self._call("rank_digests", {"names": names}, what="rank_digests")
        return {n: [replies[r][n] for r in range(self.tp_size)] for n in names}

    # ------------------------------------------------------------------ test hooks
