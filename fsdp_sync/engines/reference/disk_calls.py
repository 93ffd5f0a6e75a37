"""``update_weights_from_disk`` on a reference engine, from the client's side, and
``hash_files_ahead``: the disk method's hint that per-rank files of a version still being written
are complete, so that the workers hash them while the trainer writes the rest, and
``drop_files_ahead``: the trainer gave that version up (its sync failed), the workers close them. A mixin of
`ReferenceEngine`: it uses the engine's lock and update gate (``_gate``), its two-phase rounds
(``_two_phase``) and the worker pipes (``_send``).

Not here: what the workers check and how they read (`staging.UpdateStager`: ``hash_ahead``, the
disk stage), resolving a checkpoint (`update_items.disk_items`), the trainer's side
(`fsdp_sync.transport.disk_ranked.HashAhead`).
"""

from __future__ import annotations

import os
import re
from typing import Sequence

from ..base import WeightUpdateError
from .scheduler import check_version
from .update_items import disk_items

__all__ = ["DiskCalls"]

_RANK_FILE = re.compile(r"^model-rank-(\d+)-part-\d+\.safetensors$")   # hf_checkpoint.RANK_FILE_PATTERN


class DiskCalls:
    """`ReferenceEngine`'s disk-update methods (see the module docstring)."""

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 flush_cache: bool = True, *, weight_version: str | None = None,
                                 require_complete: bool = False) -> None:
        """Load the tensors of a Hugging Face safetensors checkpoint directory (SGLang's call).

        SGLang's rules: an index (``model.safetensors.index.json``) decides the files and a
        missing indexed file fails before anything loads; without one every ``*.safetensors``
        file loads; only the names present are updated (``require_complete=True``, what
        `fsdp-sync serve` asks: a checkpoint that lacks any tensor this engine holds is refused).
        A ``config.json`` beside the weights must agree with the engine's model in every value
        that changes its math (`config_check`). All or nothing, unlike SGLang 0.5.23: the files'
        digests (each worker hashes its share) and every tensor's name, dtype and shape are checked
        on every worker before any weight changes (HF files: slices staged; per-rank files: read
        into the weights at the commit). Raises `WeightUpdateError` naming the file or tensor; the
        old weights keep serving. ``weight_version`` as for tensors; ``disk_tensors_loaded``."""
        from ...weights.hf_checkpoint import CheckpointError

        what = f"update_weights_from_disk({str(model_path)!r})"
        check_version(weight_version, what)
        with self._gate(what):
            self._check_usable()
            self._check_not_aborted(what)
            try:
                per_rank = disk_items(model_path, load_format, self.layout, self.config,
                                      complete=bool(require_complete))
            except Exception as exc:  # noqa: BLE001 - whatever it is, this call failed
                # (an unreadable directory is an OSError, not a CheckpointError): nothing loaded
                why = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
                err = WeightUpdateError(f"{what}: {why}")
                self._abort_all(what, str(err))       # a refused call ends an open transaction too
                raise err from exc
            staged = self._two_phase(per_rank, what)
            tp = self.tp_size
            self.disk_bytes_read = [int(staged[r][1].get("bytes_read", 0)) for r in range(tp)]
            self.disk_seconds = {k: max(float(rs[r][1].get(f, 0.0)) for r in range(tp)) for k, f, rs in
                                 (("read_hash_s", "stage_s", staged), ("copy_s", "commit_s", self._committed))}
            self.disk_seconds["files_hashed_ahead"] = sum(int(staged[r][1].get("hashed_ahead", 0))
                                                          for r in range(tp))
            counts = [int(staged[r][1].get("tensors", 0)) for r in range(tp)]
            # HF files: every rank reads every header; per-rank files: each its own tensors
            self.disk_tensors_loaded = counts[0] if per_rank[0][0][1] == "hf" else sum(counts)
            self._after_update(weight_version, flush_cache)

    def hash_files_ahead(self, directory: str, files: Sequence[str], hash: str,
                         published: str | None = None) -> None:
        """A hint, sent without waiting: ``files`` (per-rank file names, ``model-rank-{r}-part-{k}``)
        in ``directory`` are complete; worker r hashes its own under ``hash`` and keeps them open
        for the next ``update_weights_from_disk``, which takes one as checked only while it is the
        very file it hashed (device, inode, size, mtime) with the digest its manifest names, and
        hashes every other file itself. ``published``: the name ``directory`` will have once the
        version is published, where a worker that comes to the hint only after the rename finds
        the files. Nothing is loaded or changed. Does nothing while another call holds the engine
        or a worker is gone (the update then hashes the files itself)."""
        by_rank: dict[int, list[str]] = {}
        for f in files:
            m = _RANK_FILE.match(os.path.basename(str(f)))
            if m and int(m.group(1)) < self.tp_size:
                by_rank.setdefault(int(m.group(1)), []).append(os.path.basename(str(f)))
        if not by_rank or not self._lock.acquire(blocking=False):
            return
        try:
            if self.closed or self._broken or not all(p.is_alive() for p in self._w.procs):
                return
            seq = next(self._seq)
            for r, fs in sorted(by_rank.items()):
                self._send(r, seq, "hash_ahead", {"dir": os.fspath(directory), "files": fs, "hash": str(hash),
                                                   "published": os.fspath(published) if published else None},
                           "hash_files_ahead")
        finally:
            self._lock.release()

    def drop_files_ahead(self, directory: str) -> None:
        """The version ``directory`` (as given to `hash_files_ahead`) will not be loaded: the
        trainer's sync failed and removed it. Every worker closes the files it hashed ahead for it
        and the directory, so the deleted files' disk space is freed now (after a full disk, the
        retry needs it) instead of at the next update. Nothing else changes; files of another
        directory stay. Waits for the workers; does nothing on an engine shut down or broken."""
        if self.closed or self._broken:
            return
        self._call("drop_ahead", {"dir": os.fspath(directory)}, what="drop_files_ahead")
