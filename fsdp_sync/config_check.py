"""The model-config values that change an engine's math, compared between trainer and engine.

Two models with equal tensor shapes can still compute different logits: another rope theta or
scaling, norm epsilon, activation or MoE routing. A sync between them moves every byte exactly
and `verify` passes, yet every rollout is silently wrong. `config_mismatches` compares the values
in `MATH_KEYS` of two Hugging Face configs (or any objects with those attributes);
`check_configs` raises naming each differing key with both values. The manager runs it at the
first sync against every engine that exposes its model config, and again at a sync after a value
of the trainer's changed (`math_key`) (``engine.config``: the reference
engine does; an SGLang server does not report its config, so it is not checked), in
`check_engine`, which also compares the engine's TP with the mesh's and its quantization with the
sync's, and asks the engine whether it would load the sync wrongly (`load_refusal`: SGLang's Llama
loader drops block-FP8 scales on every path but fsdp_sync's per-rank loader), whether its release
can run the sync's `SyncConfig` values at all (`sync_refusal`: a ``"retract"`` pause against an
SGLang whose scheduler dies of the sync's cache flush) and whether SGLang would serve the model
other than the trainer computes it (`served_refusal`: a tied MoE model).

Floats compare exactly: these are configuration values, not computed ones. A key missing on one
side and present on the other counts as a difference (unless the side that has it holds the
value transformers assumes when it is absent, `DEFAULTS`). Rope values are read from
transformers 5's ``rope_parameters`` or transformers 4's attributes alike.

Not here: shapes and names (the layout map and the engines' own checks refuse those).
"""

from __future__ import annotations

from typing import Any

from .weights.fp8_config import KEYS as FP8_IGNORED_KEYS, config_refusal, quantization_config

__all__ = ["MATH_KEYS", "config_mismatches", "check_configs", "check_engine", "model_config", "math_key",
           "through_own_loader", "load_refusal", "sync_refusal", "served_refusal"]

MATH_KEYS = (
    # sizes (shapes catch most, but not a transposed split of equal products)
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim",
    # the math between the weights
    "hidden_act", "rms_norm_eps", "layer_norm_eps", "rope_theta", "rope_scaling",
    "partial_rotary_factor", "attention_bias", "mlp_bias", "tie_word_embeddings",
    "use_sliding_window", "sliding_window", "max_window_layers",
    # mixture of experts: routing
    "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
    "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
    "mlp_only_layers",
    # FP8: the layers the engine builds unquantized (the sync sends those in the rollout dtype)
    "quantization_config.ignored",
)
"""Not compared: what only training or serving reads (``router_aux_loss_coef``, a loss weight;
``max_position_embeddings``; dropout), and the sliding-window sizes while the window is off."""
DEFAULTS = {"tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
            "rope_scaling": None, "partial_rotary_factor": 1.0, "use_sliding_window": False}
_MISSING = object()


def _value(cfg: Any, key: str) -> Any:
    if key == "quantization_config.ignored":
        qc = quantization_config(cfg) or {}
        listed = next((qc[k] for k in FP8_IGNORED_KEYS if qc.get(k)), None)
        return _MISSING if not listed else sorted(str(e).removeprefix("model.") for e in listed)
    if key == "head_dim":
        hd = getattr(cfg, "head_dim", None)
        if hd is None and getattr(cfg, "hidden_size", None) and getattr(cfg, "num_attention_heads", None):
            hd = cfg.hidden_size // cfg.num_attention_heads
        return _MISSING if hd is None else int(hd)
    if key in ("rope_theta", "rope_scaling"):
        # transformers 5 keeps both in rope_parameters (rope_scaling aliases it); 4 as attributes
        rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        rp = rp if isinstance(rp, dict) else {}
        if key == "rope_theta":
            v = getattr(cfg, "rope_theta", None)
            v = rp.get("rope_theta") if v is None else v
            return _MISSING if v is None else float(v)
        rest = {k: v for k, v in rp.items() if k != "rope_theta"}
        return None if rest in ({}, {"rope_type": "default"}, {"type": "default"}) else rest
    if key in ("use_sliding_window", "sliding_window", "max_window_layers"):
        # a window that is off does not change the math, whatever its sizes say. Qwen2/3 switch
        # it with use_sliding_window; Mistral and Mixtral have no switch: a sliding_window is on
        on = getattr(cfg, "use_sliding_window", None)
        on = getattr(cfg, "sliding_window", None) is not None if on is None else bool(on)
        if not on:
            return False if key == "use_sliding_window" else _MISSING
        if key == "use_sliding_window":
            return True
    v = getattr(cfg, key, _MISSING)
    return DEFAULTS.get(key, _MISSING) if v is _MISSING else v


def model_config(module: Any) -> Any:
    """The Hugging Face config of ``module`` (through FSDP1 / DDP-style wrappers), or None."""
    for _ in range(4):
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            return cfg
        inner = getattr(module, "_fsdp_wrapped_module", None) or getattr(module, "module", None)
        if inner is None or inner is module:
            return None
        module = inner
    return None


def math_key(module: Any) -> tuple | None:
    """What `MATH_KEYS` read in ``module``'s config (`model_config`), comparable: it differs
    once one of those values changed (None: the module has no config)."""
    cfg = model_config(module)
    return None if cfg is None else tuple(repr(_value(cfg, k)) for k in MATH_KEYS)


def config_mismatches(trainer: Any, engine: Any) -> list[tuple[str, Any, Any]]:
    """``(key, trainer value, engine value)`` for every key of `MATH_KEYS` that differs."""
    out = []
    for key in MATH_KEYS:
        a, b = _value(trainer, key), _value(engine, key)
        if a is _MISSING and b is _MISSING:
            continue
        if a != b:
            out.append((key, None if a is _MISSING else a, None if b is _MISSING else b))
    return out


def check_configs(trainer: Any, engine: Any, *, where: str = "") -> None:
    """Raise ValueError naming every math-changing config value that differs (see module)."""
    diff = config_mismatches(trainer, engine)
    if diff:
        listed = "; ".join(f"{k}: trainer {a!r}, engine {b!r}" for k, a, b in diff)
        raise ValueError(f"the engine's model config differs from the trainer's in values that "
                         f"change its outputs ({listed}): the sync would move every byte and the "
                         f"engine would still compute other logits. Start the engine from the "
                         f"trainer's config{f' ({where})' if where else ''}")


def check_engine(module: Any, engine: Any, config: Any, topo: Any, *, where: str) -> None:
    """What the manager checks of an engine before its first sync, raising ValueError naming both
    values and what to change: the tensor method's engine runs the mesh's infer-TP size (infer-TP
    rank r makes engine TP rank r's payload: otherwise the engine refuses the first bucket for
    its count of payloads, after the wake-up and a gather), it serves the sync's quantization,
    its release can run the sync (`sync_refusal`, before the manager pauses anything) and its
    model config computes what the trainer's does (`check_configs`)."""
    tp = getattr(engine, "tp_size", None)
    if config.method == "tensor" and topo is not None and isinstance(tp, int) and tp != topo.tp_size:
        raise ValueError(f"the engine runs TP {tp} but the mesh's infer_tp has {topo.tp_size} rank(s): "
                         f"the tensor method sends one payload per engine TP rank, one from each "
                         f"infer-TP rank; make the mesh with infer_tp={tp} (make_mesh(dp=world // {tp}, "
                         f"infer_tp={tp})) or start the engine with tp_size={topo.tp_size} ({where})")
    want, held = config.quantization, getattr(engine, "quantization", "unknown")
    if (held is None or isinstance(held, str)) and held != "unknown" and held != want:
        # an FP8 config makes the engine FP8 whatever it was started with: say that, not "restart it"
        forced = config_refusal(model_config(module), want) if want is None else None
        if forced:
            raise ValueError(f"the engine serves quantization={held!r}: {forced} ({where})")
        raise ValueError(f"the engine serves quantization={held!r} but SyncConfig.quantization="
                         f"{want!r}: a sync would send weights in a format the engine does not "
                         f"hold; set SyncConfig.quantization={held!r} or start the engine with "
                         f"quantization={want!r} ({where})")
    why = (load_refusal(module, engine, config) or sync_refusal(engine, config)
           or served_refusal(module, engine))
    if why:
        raise ValueError(f"{why} ({where})")
    mine, theirs = model_config(module), getattr(engine, "config", None)
    if mine is not None and theirs is not None and hasattr(theirs, "to_dict"):
        check_configs(mine, theirs, where=where)


def through_own_loader(config: Any, engine: Any) -> bool:
    """Whether a sync reaches ``engine`` as Hugging Face tensors for the engine's own loader: always
    but for the tensor method's per-rank buckets, which it sends (`TensorTransport._choose_layout`)
    with ``layout`` "engine" or "auto", ``strategy="flattened"`` and an engine that takes them
    (``accepts_rank_buckets``; SGLang: fsdp_sync's custom loader, loading by engine name)."""
    return not (getattr(config, "method", None) == "tensor"
                and getattr(config, "layout", "full") in ("engine", "auto")
                and getattr(config, "strategy", None) == "flattened"
                and bool(getattr(engine, "accepts_rank_buckets", False)))


def served_refusal(module: Any, engine: Any) -> str | None:
    """Why SGLang itself would serve ``module``'s model other than the trainer computes it, whatever
    a sync sends (`engines.sglang.served_config.model_refusal`: a tied Qwen3-MoE / Qwen2-MoE /
    Mixtral, whose head SGLang keeps apart); None for any other engine. SGLang is told apart as
    `verify.sent_record` does: it has no full-tensor digests (``fsdp-sync serve`` has)."""
    serves = getattr(engine, "serves_tensor_checksums", None)
    cfg = model_config(module)
    if cfg is None or not callable(serves):
        return None
    from .engines.sglang.served_config import model_refusal

    why = model_refusal(cfg)
    return why if why and not serves() else None    # asked only then: over HTTP, a request


def load_refusal(module: Any, engine: Any, config: Any) -> str | None:
    """The engine's own word (``engine.load_refusal(quantization, model_type, own_loader=)``, where
    it has one: `SGLangEngine`) on a sync it would load wrongly, e.g. SGLang's Llama loader, which
    drops block-FP8 scales; None where it has none or loads it right."""
    ask = getattr(engine, "load_refusal", None)
    quantization = getattr(config, "quantization", None)
    if quantization is None or not callable(ask):
        return None
    model_type = getattr(model_config(module), "model_type", None)
    return ask(quantization, model_type, own_loader=through_own_loader(config, engine))


def sync_refusal(engine: Any, config: Any) -> str | None:
    """The engine's own word (``engine.sync_refusal(pause_mode=, verify=, dtype=)``, where it has
    one: `SGLangEngine`) on `SyncConfig` values its release or launch cannot run, e.g.
    ``pause_mode="retract"`` against an SGLang whose scheduler dies of the flush the sync's update
    asks for, or a ``dtype`` other than the server's explicit ``--dtype`` (its loader would cast
    every tensor again); None where it has none or can run them."""
    ask = getattr(engine, "sync_refusal", None)
    if not callable(ask):
        return None
    return ask(pause_mode=getattr(config, "pause_mode", None), verify=getattr(config, "verify", "off"),
               dtype=getattr(config, "dtype", None))
