"""What an SGLang server would do wrong with a sync, said before anything is sent: a mixin of
`adapter.SGLangEngine` (it provides ``features``, ``where``, ``is_http``, ``tp_size``,
``server_info`` and ``serves_tensor_checksums``). Also `Refusals.accepts_rank_buckets`: what the
caller said of the server's loader, unless its launch arguments say otherwise.
`config_check.check_engine` asks both methods before the first sync with an engine, so the sync
is refused on every trainer rank before any pause, write or update.

- `load_refusal`: a quantization SGLang's own loader would load wrongly (block FP8 of a Llama
  model loses every scale: `FP8_SCALES_DROPPED`).
- `sync_refusal`: a release older than any fsdp_sync supports (`versions.OLDEST`), and
  `SyncConfig` values the release cannot run (`versions`): a ``"retract"`` pause
  against a release whose scheduler dies of the sync's cache flush; ``verify`` against a server
  at TP > 1 whose ``/weights_checker`` answers TP rank 0 only (0.5.12: the sync would load every
  weight, then fail to check ranks 1 and up; checking rank 0 alone would be no verify), and a
  ``SyncConfig.dtype`` other than the server's explicit ``--dtype`` (`dtype_refusal`; asked only
  where the caller passes ``dtype=``).

Not here: the release table itself (`versions`), refusals of one call's own arguments (the adapter's
``disk_option_refusal``, `versions.SGLangFeatures.refuse_checker_fields`).
"""

from __future__ import annotations

import logging
from typing import Any

from .client import MissingMethod, NotFound, SGLangError

log = logging.getLogger(__name__)

__all__ = ["FP8_SCALES_DROPPED", "Refusals", "SGLANG_DTYPES", "dtype_refusal", "scales_dropped"]

FP8_SCALES_DROPPED = frozenset({"llama"})
"""``model_type`` values whose SGLang model class (``LlamaForCausalLM``, read in 0.5.23) renames a
checkpoint's ``weight_scale_inv`` to ``weight_scale`` in ``load_weights``: block FP8 has no such
parameter, so every block scale is skipped (the sglang tier asserts it: ``test_sglang_fp8``)."""


def scales_dropped(quantization: str | None, model_type: str | None, *, own_loader: bool) -> str | None:
    """Why SGLang itself (not ``fsdp-sync serve``) would load a sync of ``quantization`` for a
    ``model_type`` model through its own ``load_weights`` (``own_loader``) wrongly: block FP8 of a
    `FP8_SCALES_DROPPED` model loses every scale. None where it loads it right (`Refusals.load_refusal`;
    `fsdp_sync.plan` asks it for ``--engine sglang``)."""
    if quantization != "fp8" or model_type not in FP8_SCALES_DROPPED or not own_loader:
        return None
    return (f"quantization='fp8' for a {model_type!r} model through SGLang's own load_weights "
            f"(update_weights_from_disk, update_weights_from_distributed, or "
            f"update_weights_from_tensor with full tensors): SGLang's LlamaForCausalLM renames "
            f"every '...weight_scale_inv' to '...weight_scale', a parameter block FP8 does not "
            f"have, so every block scale would be dropped without a word and the FP8 weights "
            f"served with the scales SGLang allocated. Use method='tensor' with layout='engine' "
            f"(or 'auto') and strategy='flattened', SGLang started with --custom-weight-loader "
            f"fsdp_sync.engines.sglang.loader.load_rank_buckets and "
            f"SGLangEngine(..., rank_bucket_loader=True) (fsdp_sync's loader loads the scales by "
            f"name), or quantization=None")


SGLANG_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                 "float": "float32", "float32": "float32"}
"""SGLang's ``--dtype`` values (0.5.12 and 0.5.23) that name one dtype; ``auto`` follows the
checkpoint's ``torch_dtype`` and says nothing here."""


def dtype_refusal(launched: Any, dtype: Any) -> str | None:
    """Why a sync casting to ``dtype`` (a torch dtype) cannot go to a server launched with
    ``--dtype launched``: its loader casts every tensor again (``param.data.copy_``: float16 from
    bfloat16 turns values past 65504 into inf; into a narrower dtype the trainer's low bits are
    lost) and the trainer's digests of what it sent never match. None where either is unknown."""
    served = SGLANG_DTYPES.get(launched) if isinstance(launched, str) else None
    sent = str(dtype).removeprefix("torch.") if dtype is not None else None
    if served is None or sent is None or served == sent:
        return None
    return (f"SGLang was launched with --dtype {launched} ({served}) but SyncConfig.dtype="
            f"torch.{sent}: its loader would cast every tensor again (a second cast that may change "
            f"values: bfloat16 into float16 overflows past 65504), so the engine would not hold the "
            f"trainer's weights; set SyncConfig.dtype=torch.{served} or restart the server with "
            f"--dtype {sent}")


class Refusals:
    """`SGLangEngine`'s answers to `config_check` (see the module docstring)."""

    @property
    def accepts_rank_buckets(self) -> bool:
        """Whether per-rank buckets go to fsdp_sync's loader (`SyncConfig.layout` "engine"/"auto"):
        ``rank_bucket_loader=True``, unless the server's launch arguments (``get_server_info``'s
        ``custom_weight_loader``, a list in 0.5.12 and 0.5.23) show that loader is not registered.
        SGLang would then meet the first per-rank bucket with ``NotImplementedError("Unknown
        load_format=...")`` inside its scheduler, not a refusal; here it is False instead, said in
        a warning naming ``--custom-weight-loader``: "auto" sends full tensors, "engine" is refused
        before anything is sent. A server whose arguments cannot be read is taken at its word."""
        said = self.__dict__.get("_rank_bucket_loader", False)
        if not said:
            return False
        known = self.__dict__.get("_loader_registered")
        if known is None:
            known = self._loader_registered()
            if known is not None:
                self.__dict__["_loader_registered"] = known
        return known is not False

    @accepts_rank_buckets.setter
    def accepts_rank_buckets(self, value: bool) -> None:
        self.__dict__["_rank_bucket_loader"] = bool(value)
        self.__dict__.pop("_loader_registered", None)

    def _loader_registered(self) -> bool | None:
        from .loader import LOADER

        info = self.__dict__.get("_info")
        if not isinstance(info, dict):
            try:
                info = self.server_info()
            except (SGLangError, NotFound, MissingMethod):
                return None
        loaders = info.get("custom_weight_loader") if isinstance(info, dict) else None
        if not isinstance(loaders, list):
            return None
        if LOADER in loaders:
            return True
        log.warning("fsdp_sync: SGLang%s was not started with --custom-weight-loader %s (its "
                    "custom_weight_loader is %s), though rank_bucket_loader=True: it cannot load "
                    "per-rank buckets, so none are sent (layout='auto' sends full tensors, "
                    "layout='engine' is refused); restart it with that option to send them",
                    self.where or " in process", LOADER, loaders)
        return False

    def load_refusal(self, quantization: str | None, model_type: str | None, *,
                     own_loader: bool) -> str | None:
        """Why SGLang would load a sync of ``quantization`` for a ``model_type`` model wrongly, or
        None (`config_check.load_refusal` asks it before anything is written or sent).
        ``own_loader``: the weights reach SGLang's own ``model.load_weights`` (the disk and
        distributed methods, and the tensor method's full tensors), not fsdp_sync's per-rank loader
        (`loader`), which loads parameters by engine name. Block FP8 of a Llama model through its
        own loader loses every scale (`FP8_SCALES_DROPPED`). ``fsdp-sync serve`` (the reference
        engine behind SGLang's API) loads them: not refused."""
        why = scales_dropped(quantization, model_type, own_loader=own_loader)
        if why is None or self.serves_tensor_checksums():      # asked only when it matters
            return None
        return why

    def sync_refusal(self, *, pause_mode: str | None = None, verify: str = "off",
                     dtype: Any = None) -> str | None:
        """Why this SGLang release cannot run a sync with `SyncConfig`'s ``pause_mode`` and
        ``verify``, or None (`config_check.sync_refusal` asks it before anything is sent): a
        release older than `versions.OLDEST` (`versions.SGLangFeatures.refuse_release`),
        ``pause_mode="retract"`` where the sync's flush would kill the server
        (`versions.SGLangFeatures.refuse_pause_mode`), ``verify`` where a server's checker answers
        TP rank 0 only (`versions.SGLangFeatures.refuse_verify`; not ``fsdp-sync serve``, whose
        full-tensor digests are the check; in process there is no checker at all, which the
        verify itself says), ``dtype`` (`SyncConfig.dtype`, where the caller passes it) other
        than the server's explicit ``--dtype`` (`dtype_refusal`)."""
        why = self.features.refuse_release() or self.features.refuse_pause_mode(pause_mode)
        if why is None and dtype is not None:
            info = self.__dict__.get("_info")
            if not isinstance(info, dict):
                try:
                    info = self.server_info()
                except (SGLangError, NotFound, MissingMethod):
                    info = None
            why = dtype_refusal(info.get("dtype") if isinstance(info, dict) else None, dtype)
        if why is None and self.is_http:
            why = self.features.refuse_verify(verify, self.tp_size)
            if why and self.serves_tensor_checksums():      # asked only then: a request
                why = None
        return f"{why} (SGLang{self.where or ' in process'})" if why else None
