"""What differs between the SGLang releases fsdp_sync talks to: a table of facts by version, and
the release an adapter reports.

`features(version)` answers from the version string SGLang reports (``version`` in
``get_server_info``, HTTP or in process; `reported`). ``None`` (a server that does not say, e.g.
``fsdp-sync serve``) gets the newest behaviour, and the adapter probes where it can.

Read from the wheels of 0.5.12 (verl 0.9.1's ``verl[sglang]`` pin), 0.5.20, 0.5.21 and 0.5.23
(paths under ``sglang/srt/``); `make test-sglang` checks the table against the installed 0.5.12
and 0.5.23 (``tests/sglang_tier/test_real_sglang.py``). Where a fact changed between two releases
that were read, the first one read that has it is named (the change may be older).

- Weight-update session (``begin_weight_update`` / ``end_weight_update``, Engine methods and
  ``POST`` routes; updates outside one are refused): 0.5.21 on. 0.5.12 and 0.5.20 have none.
- ``POST /weights_checker``: 0.5.12 has it, with ``CheckWeightsReqInput`` = ``action`` only
  (extra fields are dropped without a word, so ``skip_tensor_list`` would be ignored);
  ``allow_quant_error`` by 0.5.20; ``skip_tensor_list`` and ``selector`` from 0.5.21. Its checksum
  answer in 0.5.12 is ``{success, message, ranks: [{checksums, parallelism_info}]}`` (no
  ``per_gpu_checksum``, no ``per_engine_checksum``, no ``role``), hashed by the same
  ``mm_utils.tensor_hash`` (sha256 on CPU, the same Triton tile hash on GPU) over every parameter
  and buffer but ``cos_sin_cache`` / ``inv_freq`` / ``freqs_cis`` / ``_weight_fp32``; it calls
  ``torch.cuda.synchronize()``, so a CPU-only 0.5.12 server answers it with an error.
- LoRA from tensors (``load_lora_adapter_from_tensors``): 0.5.12 takes ONE payload for all TP
  ranks, ``serialized_tensors: str`` (in process the Engine serializes a dict itself; with
  ``load_format="flattened_bucket"`` the caller's one payload); 0.5.20 on take one per TP rank,
  ``serialized_named_tensors: List[bytes]`` (base64 over HTTP), plus ``expected_checksums``.
- ``update_weights_from_distributed(load_format="flattened_bucket")``: every release read packs the
  bucket tightly in ``names`` order (``torch.cat`` of the tensors' bytes in 0.5.12 and 0.5.20,
  ``FlattenedTensorBucket.empty`` in 0.5.23). Only 0.5.23 refuses a misaligned offset before it
  joins the broadcast; the older ones fail in ``reconstruct_tensors`` after it (fsdp_sync's
  `wire` sends aligned buckets only). Its arguments and HTTP body are the same in all.
- ``update_weights_from_tensor`` (payload per TP rank: base64 text over HTTP in all;
  ``List[Union[str, bytes]]`` in 0.5.12, ``Base64Bytes`` from 0.5.20), ``update_weights_from_disk``,
  ``init_weights_update_group`` / ``destroy_weights_update_group``, the memory tags and
  ``get_weights_by_name`` take the same arguments in all. The flattened-bucket metadata is read by
  attribute (name, shape, dtype, start_idx, end_idx, numel) in all.
- Unpickler: 0.5.12 and 0.5.20 allow whole module prefixes (``builtins.``, ``types.``,
  ``torch.``, ``sglang.srt.model_executor.model_runner.``...); 0.5.21 on allow exact
  ``(module, name)`` pairs (``SafeUnpickler.ALLOWED_GLOBALS``). fsdp_sync's payloads pass both.
- ``LocalSerializedTensor`` lives in ``model_executor.model_runner`` in 0.5.12 and in
  ``model_executor.model_runner_components.weight_updater`` from 0.5.20; a server's payload names
  the path of the server's release (``local_serialized_tensor_module``), not the trainer's.
- A cache flush while ``pause_generation(mode="retract")`` holds the requests it moved from the
  running batch to the waiting queue: 0.5.12 and 0.5.20 flush only when the waiting queue is empty
  too (``Scheduler.is_fully_idle``), so an update sent with ``flush_cache=True`` fails its flush,
  which the scheduler ``assert``s (``flush_cache_after_weight_update``): the server dies. 0.5.21
  on ignore the waiting queue while paused (``is_fully_idle(ignore_waiting=self._engine_paused)``).
- ``/weights_checker``'s checksum answer with TP > 1: 0.5.12 answers TP rank 0's only (only the
  scheduler of attention-TP rank 0 has a socket to the tokenizer, and its ``check_weights``
  gathers nothing; one entry per data-parallel replica); 0.5.20 on gather every TP rank's
  (``all_gather_object`` over the TP group, ``check_weights``). Between the two: not read.
- ``GET /get_weight_version`` answers 404 ("deprecated, use /model_info") in 0.5.12 and 0.5.20 and
  is gone from 0.5.21; ``/get_model_info``'s ``weight_version`` is the version in all.

Imports nothing but the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECKED", "OLDEST", "SESSION_SINCE", "CHECKER_SKIP_LIST_SINCE", "LORA_ONE_PAYLOAD_UNTIL",
           "LORA_PER_RANK_SINCE", "RETRACT_FLUSH_SINCE", "CHECKER_ONE_RANK_UNTIL",
           "CHECKER_ALL_RANKS_SINCE", "SGLangFeatures", "parse", "features",
           "reported"]

CHECKED = ("0.5.12", "0.5.23")
"""The releases `make test-sglang` runs fsdp_sync's payloads, receivers and adapter against."""

OLDEST = (0, 5, 12)
"""The oldest release supported (the ``sglang`` extra's ``sglang>=0.5.12``): an older one is refused
at the first sync (`SGLangFeatures.refuse_release`), as none of its calls was read. A release newer
than the newest in `CHECKED` gets the newest behaviour."""

SESSION_SINCE = (0, 5, 21)
CHECKER_SKIP_LIST_SINCE = (0, 5, 21)
LORA_ONE_PAYLOAD_UNTIL = (0, 5, 12)   # the last release read with one LoRA payload for all ranks
LORA_PER_RANK_SINCE = (0, 5, 20)      # the first release read with one per TP rank
RETRACT_FLUSH_SINCE = (0, 5, 21)      # the first release read whose flush survives a retract pause
CHECKER_ONE_RANK_UNTIL = (0, 5, 12)   # the last release read whose checker answers TP rank 0 only
CHECKER_ALL_RANKS_SINCE = (0, 5, 20)  # the first release read whose checker gathers every TP rank


def parse(version: str | None) -> tuple[int, ...] | None:
    """``"0.5.12"`` -> ``(0, 5, 12)``; a suffix (``"0.5.23rc1"``, ``"0.5.12.post1"``) is dropped;
    None or anything without a leading ``X.Y.Z`` gives None."""
    if not isinstance(version, str):
        return None
    m = re.match(r"\s*v?(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in m.groups()) if m else None


@dataclass(frozen=True)
class SGLangFeatures:
    """What one SGLang release takes (see the module docstring for where each fact was read)."""

    version: str | None
    weight_update_session: bool
    weights_checker_fields: tuple[str, ...]
    lora_tensors_field: str | None
    """The request field of ``load_lora_adapter_from_tensors``'s payloads; None: a release between
    0.5.12 and 0.5.20, not read (a LoRA sync into it is refused rather than guessed)."""
    lora_tensors_per_rank: bool | None
    distributed_bucket_prechecked: bool
    local_serialized_tensor_module: str | None = None
    """Where the release keeps ``LocalSerializedTensor`` (per-rank values of a tensor update):
    pickled under this path for a server, whatever the trainer has installed; None: not read."""
    retract_kills_flush: bool = False
    """A flush fails while a ``"retract"`` pause holds re-queued requests, and an update's failed
    flush kills the server (before `RETRACT_FLUSH_SINCE`)."""
    checker_every_tp_rank: bool | None = True
    """``/weights_checker``'s checksum answer holds every TP rank's entry (False: TP rank 0's only,
    up to `CHECKER_ONE_RANK_UNTIL`; None: a release between, not read)."""

    @property
    def label(self) -> str:
        return f"SGLang {self.version}" if self.version else "this SGLang server (version not reported)"

    def refuse_release(self) -> str | None:
        """Why fsdp_sync cannot sync into this release at all (None: it can): one older than
        `OLDEST`, whose weight-update, memory and checker calls were never read (a request
        body, payload or tag it takes differently could load or free the wrong thing)."""
        v = parse(self.version)
        if v is None or v >= OLDEST:
            return None
        return (f"{self.label} is older than the releases fsdp_sync supports (>="
                f"{'.'.join(map(str, OLDEST))}; checked against {' and '.join(CHECKED)}): its "
                f"weight-update, memory and /weights_checker calls were never read, so a sync "
                f"could be taken other than sent; upgrade SGLang to >={'.'.join(map(str, OLDEST))}")

    def refuse_pause_mode(self, mode: str | None) -> str | None:
        """Why a sync paused with ``pause_generation(mode)`` cannot run on this release (None: it
        can): under ``"retract"`` the sync's update flushes, which kills the server
        (`retract_kills_flush`)."""
        if mode != "retract" or not self.retract_kills_flush:
            return None
        return (f"pause_mode='retract' against {self.label}: a retract pause moves the running "
                f"requests to the scheduler's waiting queue, and this release flushes the cache only "
                f"when that queue is empty, so the sync's update (sent with flush_cache=True, as the "
                f"old weights' cached KV must go) fails its flush, on which SGLang's scheduler asserts "
                f"and the server dies; use pause_mode='abort' or None (the update waits for the "
                f"running requests), or upgrade SGLang to "
                f">={'.'.join(map(str, RETRACT_FLUSH_SINCE))}")

    def refuse_verify(self, verify: str, tp_size: int) -> str | None:
        """Why ``SyncConfig.verify`` cannot check a server of this release run at TP ``tp_size``
        (None: it can, or the release was not read and its answer is checked when it comes): a
        checker that answers TP rank 0 only leaves the other ranks unchecked, and a check of rank
        0 alone is not a verify (`checker_every_tp_rank`)."""
        if verify == "off" or tp_size <= 1 or self.checker_every_tp_rank is not False:
            return None
        return (f"verify={verify!r} against {self.label} with tp_size={tp_size}: its /weights_checker "
                f"answers with TP rank 0's checksums only (it gathers none from TP ranks "
                f"1..{tp_size - 1}), so the weights those ranks serve cannot be checked, and a check "
                f"of rank 0 alone is no verify; set SyncConfig.verify='off' (under verl: "
                f"rollout.custom.fsdp_sync.verify=off), or upgrade SGLang to "
                f">={'.'.join(map(str, CHECKER_ALL_RANKS_SINCE))}, whose checker answers every TP "
                f"rank")

    def refuse_checker_fields(self, fields: set[str] | frozenset[str]) -> str | None:
        """Why this release cannot take ``/weights_checker`` fields ``fields`` (None: it can)."""
        missing = sorted(set(fields) - set(self.weights_checker_fields))
        if not missing:
            return None
        return (f"{self.label}'s /weights_checker takes only {list(self.weights_checker_fields)} and "
                f"drops {missing} without a word; leave {missing} out or upgrade SGLang to "
                f">={'.'.join(map(str, CHECKER_SKIP_LIST_SINCE))}")


def features(version: str | None) -> SGLangFeatures:
    """The table's row for ``version`` (None or unparsable: the newest behaviour)."""
    v = parse(version)
    newest = v is None
    session = newest or v >= SESSION_SINCE
    if newest or v >= CHECKER_SKIP_LIST_SINCE:
        checker = ("action", "allow_quant_error", "skip_tensor_list", "selector")
    elif v >= (0, 5, 20):
        checker = ("action", "allow_quant_error")
    else:
        checker = ("action",)
    if newest or v >= LORA_PER_RANK_SINCE:
        lora_field, per_rank = "serialized_named_tensors", True
    elif v <= LORA_ONE_PAYLOAD_UNTIL:
        lora_field, per_rank = "serialized_tensors", False
    else:
        lora_field = per_rank = None
    if newest or v >= LORA_PER_RANK_SINCE:       # moved in 0.5.20, as the LoRA field changed
        local = "sglang.srt.model_executor.model_runner_components.weight_updater"
    elif v <= LORA_ONE_PAYLOAD_UNTIL:
        local = "sglang.srt.model_executor.model_runner"
    else:
        local = None
    return SGLangFeatures(version=version if isinstance(version, str) else None,
                          weight_update_session=session, weights_checker_fields=checker,
                          lora_tensors_field=lora_field, lora_tensors_per_rank=per_rank,
                          distributed_bucket_prechecked=newest or v >= (0, 5, 23),
                          local_serialized_tensor_module=local,
                          retract_kills_flush=not newest and v < RETRACT_FLUSH_SINCE,
                          checker_every_tp_rank=True if newest or v >= CHECKER_ALL_RANKS_SINCE
                          else False if v <= CHECKER_ONE_RANK_UNTIL else None)


def reported(server_info: Any) -> str | None:
    """The release a ``get_server_info`` answer names (its ``version``), else None."""
    version = server_info.get("version") if isinstance(server_info, dict) else None
    return version if isinstance(version, str) and parse(version) is not None else None
