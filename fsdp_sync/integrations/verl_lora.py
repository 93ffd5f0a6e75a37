"""verl's LoRA sync as its own SGLang rollout does it, without importing verl (the verl adapter,
`integrations.verl.adapter`, calls these; so do the default tier's tests).

verl 0.9.1 serves a LoRA run (``actor_rollout_ref.model.lora_rank`` > 0, or megatron's
``lora.rank``, with ``lora.merge=false``) as an adapter: its FSDP worker syncs the base weights
once (``update_weights(..., peft_config=..., base_sync_done=False)``, names carrying peft's
``.base_layer.``, which SGLang's loader does not know: `base_name` strips it, as verl's
``_strip_lora_base_layer``), then at every sync only the adapter (``base_sync_done=True``: peft's
``lora_A``/``lora_B`` state dict, full tensors, with the adapter's ``LoraConfig`` dict), which
infer-TP rank 0 loads under verl's name `LORA_NAME`: unload it if ``/v1/models`` lists it, then
``load_lora_adapter_from_tensors`` with the config normalized as verl's
``normalize_peft_config_for_sglang`` does it (`normalize_peft_config`: enums to strings, a
``peft_type``, ``target_modules`` a list or ``"all-linear"``). Between syncs only the KV cache is
released (verl's ``sleep_level=1``), so the base stays. With merged LoRA (``lora.merge=true``) verl
folds the adapter into full weights and syncs those, like any model: nothing here applies.

`sync_adapter` is the engine's part of one adapter sync on every rank of the infer-TP group:
group rank 0 loads (`load_adapter`) and verifies (`check_adapter`: each adapter tensor as the
engine holds it, ``fsdp-sync serve``'s ``/fsdp_sync/lora_checksums`` in the engine's dtype, against
the same digest of what was sent, bit for bit) while the others wait in bounded rounds
(`topology.agree_after_rank0`); a failure raises the same `SyncError` on every rank. What the
engine's own LoRA limits refuse (`engine_refusal`) is asked before each load and, by the verl
adapter, before the base weights' sync (agreed there by the send loop's check before any byte
moves): a server launched with a smaller ``--max-lora-rank`` gets no base it could never serve an
adapter over.

`refusal` says what cannot be done exactly, naming verl's key: an adapter run whose base the
engine would never get (``rollout.name=fsdp_sync_ref`` starts without weights, and verl syncs the
base only when ``rollout.load_format`` is ``dummy``), adapters on block-FP8 rollout weights, and a
regex ``target_modules`` (SGLang takes module names or ``all-linear`` only). `no_adapter_refusal`:
an adapter run's sync without a ``peft_config`` (verl's checkpoint-engine modes send the base
weights alone, never the trained adapter: the rollout would silently serve the untrained base).

Not here: the adapter's send loop (`integrations.verl.adapter`), the engine's side
(`engines.sglang.lora`, `engines.reference.serve_lora`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping

import torch

__all__ = ["LORA_NAME", "lora_rank", "served_as_adapter", "refusal", "no_adapter_refusal",
           "base_name", "normalize_peft_config", "engine_refusal", "load_adapter", "check_adapter",
           "engine_name", "unserved", "sync_adapter"]

LORA_NAME = "verl_actor_lora_name"
"""verl's adapter name in SGLang (``SGLANG_LORA_NAME``): its server's requests carry it as ``lora_path``."""


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if isinstance(node, Mapping) or hasattr(node, "keys"):
        try:
            return node.get(key, default)
        except (AttributeError, TypeError):
            pass
    return getattr(node, key, default)


def lora_rank(model_config: Any) -> int:
    """The LoRA rank of verl's model config: fsdp's flat ``lora_rank`` or megatron's ``lora.rank``."""
    return max(int(_get(model_config, "lora_rank", 0) or 0),
               int(_get(_get(model_config, "lora") or {}, "rank", 0) or 0))


def served_as_adapter(model_config: Any) -> bool:
    """Whether verl serves this run's LoRA as an adapter (rank > 0 and not ``lora.merge``), read as
    verl reads it (``lora_served_as_adapter`` and its worker's ``peft_merge``: the value's truth,
    ``lora`` being an untyped dict, so ``merge=1`` merges): verl then sends merged full weights
    without a ``peft_config``, which an adapter run here would refuse."""
    merge = _get(_get(model_config, "lora") or {}, "merge", False)
    return lora_rank(model_config) > 0 and not merge


def refusal(config: Any, model_config: Any, rollout_name: str) -> str | None:
    """Why an adapter run cannot be synced exactly (None: it can, or it is no adapter run)."""
    if not served_as_adapter(model_config):
        return None
    r = lora_rank(model_config)
    load_format = str(_get(config, "load_format", "dummy") or "")
    if _get(config, "name") == rollout_name and "dummy" not in load_format:
        return (f"actor_rollout_ref.rollout.load_format={load_format!r} with LoRA adapters "
                f"(lora_rank={r}) on rollout.name={rollout_name}: verl then never syncs the base "
                f"weights, and fsdp-sync serve starts without them; set "
                f"actor_rollout_ref.rollout.load_format=dummy (verl syncs the base once)")
    quant = _get(config, "quantization", None)
    if quant is not None:
        return (f"actor_rollout_ref.rollout.quantization={quant!r} with LoRA adapters "
                f"(lora_rank={r}): fsdp_sync does not apply adapters over quantized rollout "
                f"weights; drop the quantization or set actor_rollout_ref.model.lora.merge=true")
    tm = _get(model_config, "target_modules", "all-linear")
    if isinstance(tm, str) and tm not in ("all-linear", "all"):
        return (f"actor_rollout_ref.model.target_modules={tm!r}: SGLang's LoRA takes module names "
                f"or 'all-linear', not a regex; list the modules")
    if _get(config, "name") != rollout_name and tm is not None and not isinstance(tm, str):
        # a real SGLang server: only the target sets its LoRA code can stack (the reference
        # engine behind rollout_name serves any); a list here may be an OmegaConf ListConfig
        from ..lora_sync import sglang_refusal

        why = sglang_refusal(list(tm))
        if why is not None:
            return f"actor_rollout_ref.model.target_modules={list(tm)}: {why}"
    return None


def no_adapter_refusal(model_config: Any) -> str:
    return (f"verl synced a LoRA run (lora_rank={lora_rank(model_config)}, lora.merge=false) "
            f"without its adapter (no peft_config: verl's checkpoint-engine modes send the base "
            f"weights only, so the rollout would serve the untrained base); use "
            f"actor_rollout_ref.rollout.checkpoint_engine.backend=naive or set "
            f"actor_rollout_ref.model.lora.merge=true")


def base_name(name: str) -> str:
    """A base weight's name as SGLang's loader knows it: peft's ``.base_layer.`` level dropped."""
    return name.replace(".base_layer.", ".") if ".base_layer." in name else name


def normalize_peft_config(peft_config: Any) -> dict:
    """verl's peft config (a ``LoraConfig.to_dict()``, or the config itself) as SGLang's adapter
    loader takes it: enums as their values, ``peft_type`` required, ``target_modules`` a sorted
    list (a set in peft) or a bare string (``"all-linear"``) kept whole. What SGLang would load
    and serve otherwise than the trainer computes is refused (`lora_sync.config_refusal`): a
    ``rank_pattern`` / ``alpha_pattern`` it ignores, an option it does not apply (rsLoRA, DoRA,
    KaSA, ...), trained biases, a regular expression, embeddings or lm_head among the targets."""
    if hasattr(peft_config, "to_dict"):
        peft_config = peft_config.to_dict()
    if not isinstance(peft_config, Mapping):
        raise TypeError(f"peft_config must be a LoraConfig dict, got {type(peft_config).__name__}")
    from ..lora_sync import config_refusal, json_ready

    out = json_ready(dict(peft_config))     # sets (exclude_modules too) as lists: JSON has none
    if "peft_type" not in out:
        raise ValueError(f"peft_config has no 'peft_type', which SGLang's adapter loader requires; "
                         f"keys: {sorted(out)}")
    tm = out.get("target_modules")
    if tm is not None and not isinstance(tm, (str, list)):
        out["target_modules"] = list(tm)

    why = config_refusal(out)       # SGLang would load it and serve another model
    if why is not None:
        raise ValueError(why)
    return out


def engine_name(name: str) -> str:
    """An adapter tensor's name as the engine reads it back (peft's ``base_model.model.`` dropped)."""
    return name.removeprefix("base_model.model.")


def load_adapter(engine: Any, named: list[tuple[str, torch.Tensor]], config: dict,
                 name: str = LORA_NAME, verify: str = "off") -> int:
    """Swap adapter ``name`` in ``engine`` as verl does: unload it where ``/v1/models`` lists it,
    then load from tensors. Returns the engine calls made. What the engine's load would refuse
    (`engine_refusal`: `SGLangEngine`'s rank and target modules against the server's launch
    arguments, a ``verify`` it cannot answer) raises before the unload, so a refused adapter
    leaves the served one in place."""
    why = engine_refusal(engine, config, [(n, t.dtype, tuple(t.shape)) for n, t in named], name,
                         verify)
    if why is not None:
        raise ValueError(f"{why}; nothing was unloaded or sent: the engine keeps the adapter it "
                         f"serves")
    calls = 1
    cards = (engine.available_models() or {}).get("data") or []
    if any(isinstance(c, dict) and c.get("id") == name for c in cards):
        engine.unload_lora_adapter(name)
        calls += 1
    engine.load_lora_adapter_from_tensors(name, named, config)
    return calls + 1


def engine_refusal(engine: Any, config: dict, metas: Any = (), name: str = LORA_NAME,
                   verify: str = "off") -> str | None:
    """Why infer-TP rank 0's ``engine`` would refuse adapter ``name`` of ``config`` (normalized,
    `normalize_peft_config`): its own ``lora_refusal`` (`SGLangEngine`: ``enable_lora``, the
    rank over ``--max-lora-rank``, target modules outside ``--lora-target-modules``, read from the
    server's launch arguments; each naming the limit, the value and the flag), or a ``verify``
    other than ``"off"`` against a server that cannot hand an adapter back (SGLang itself: only
    ``fsdp-sync serve`` has ``/fsdp_sync/lora_checksums``; `SGLangEngine.serves_tensor_checksums`
    tells them apart; before, the adapter was loaded and then the sync failed, every step).
    ``metas``: the adapter's ``[(peft name, dtype, shape)]``, empty where not known yet: the verl
    adapter asks before a LoRA run's base weights are sent too (so a server that would refuse
    every adapter sync gets no base), where only the adapter's tensors on modules outside a list
    (an adapter on ``all-linear``) are left to the load's own check. None: not known refused."""
    serves = getattr(engine, "serves_tensor_checksums", None)
    if verify != "off" and callable(serves) and not serves():
        return (f"adapter {name!r}: rollout.custom.fsdp_sync.verify={verify!r}, but the engine "
                f"({engine!r}) is SGLang, which cannot hand a LoRA adapter back (no "
                f"/fsdp_sync/lora_checksums: fsdp-sync serve's route), so every adapter sync would "
                f"load and then fail; set rollout.custom.fsdp_sync.verify=off, or serve through "
                f"rollout.name=fsdp_sync_ref")
    own = getattr(engine, "lora_refusal", None)
    why = own(config, list(metas)) if callable(own) else None
    return None if why is None else f"adapter {name!r}: the engine would refuse it: {why}"


def check_adapter(engine: Any, named: Iterable[tuple[str, torch.Tensor]],
                  name: str = LORA_NAME) -> tuple[str | None, dict[str, Any]]:
    """Verify adapter ``name`` in ``engine`` against ``named`` (what was sent): ``(error or None,
    figures)``; the error names the first tensor that differs, is missing or is extra
    (`lora_sync.check_digests`)."""
    from ..lora_sync import check_digests

    return check_digests(engine, name, named)


def unserved(engine: Any, name: str = LORA_NAME) -> None:
    """Raise where infer-TP rank 0's ``engine`` cannot take an adapter at all: it stands for a
    server rank 0 could not reach before the sync (`integrations.verl.unreached.Unreached`: every
    call absent but ``begin_weight_update``, which raises the kept error, ``EngineUnreached``,
    naming the server and what to do), or it has no ``load_lora_adapter_from_tensors``. Before,
    the adapter sync failed on every rank with ``AttributeError: available_models: ...``."""
    if callable(getattr(engine, "load_lora_adapter_from_tensors", None)):
        return
    begin = getattr(engine, "begin_weight_update", None)
    if isinstance(getattr(engine, "why", None), str) and callable(begin):
        begin()
    raise TypeError(f"adapter {name!r}: infer-TP rank 0's engine {engine!r} has no "
                    f"load_lora_adapter_from_tensors (SGLang's LoRA call): it cannot serve adapters")


def sync_adapter(engine: Any, named: list[tuple[str, torch.Tensor]], peft_config: Any, group: Any,
                 *, verify: str, name: str = LORA_NAME,
                 check: Callable[[], str | None] | None = None) -> dict[str, Any]:
    """One adapter sync's engine side (see the module docstring), on every rank of ``group``;
    ``engine`` and ``named`` matter on group rank 0 only. ``check``: run there first, its error
    (the served model's config against the actor's, where no base sync checked it yet) refuses
    the sync before anything reaches the engine. Returns rank 0's figures (``engine_calls``,
    ``load_s``, ``r``, and with ``verify`` ``verify_tensors``, ``verify_s``, ``digests``); raises
    `SyncError` on every rank if the check, the load or the verify failed."""
    from ..topology import agree_after_rank0

    out: dict[str, Any] = {"engine_calls": 0, "load_s": 0.0, "r": None}

    def work() -> str | None:
        if check is not None and (why := check()):
            return why
        unserved(engine, name)
        config = normalize_peft_config(peft_config)
        out["r"] = config.get("r")
        t0 = time.perf_counter()
        out["engine_calls"] = load_adapter(engine, named, config, name, verify)
        out["load_s"] = time.perf_counter() - t0
        if verify == "off":
            return None
        err, figures = check_adapter(engine, named, name)
        out.update(figures)
        return err

    agree_after_rank0(work, group, what=f"fsdp_sync verl adapter sync of LoRA adapter {name!r}")
    return out
