"""What the verl adapter checks of the SGLang server on infer-TP rank 0 before a sync moves a byte.

- `config_error`: before the first sync, the server against the actor's model and the sync's
  settings, as the manager checks an engine (`fsdp_sync.config_check`);
- `verify_refusal`: a ``verify`` that cannot check this server exactly (attention data parallelism).

Both return an error text or None; the adapter agrees it over the infer-TP group (`TensorTransport.send`'s
``before``). Not here: the sync (`adapter`).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from ...config_check import check_engine, load_refusal

__all__ = ["config_error", "verify_refusal"]


def config_error(model_config: Any, sync: Any, engine: Any, topo: Any) -> str | None:
    """On infer-TP rank 0, before the first sync: what the manager checks of an engine
    (`config_check.check_engine`), with verl's ``model_config.hf_config`` as the trainer's
    model config: the engine's TP against infer_tp's, its quantization against the sync's,
    the engine's own word on a sync it would load wrongly (`config_check.load_refusal`:
    SGLang's Llama loader drops every block-FP8 scale of the full tensors this adapter sends
    through its ``load_weights``), a model SGLang serves otherwise (`config_check.served_refusal`)
    and the served model's math (`config_check.check_configs`, where the server reports its
    config). The adapter always sends full tensors: checked as layout ``"full"``."""
    module = SimpleNamespace(config=getattr(model_config, "hf_config", None))
    full = dataclasses.replace(sync, layout="full")
    why = load_refusal(module, engine, full)
    if why:      # the engine's advice names per-rank buckets, which no verl adapter sends
        return (f"{why}. Under verl the adapter sends full tensors to SGLang's load_weights "
                f"(per-rank buckets need fsdp_sync's manager): for this model set "
                f"actor_rollout_ref.rollout.quantization=null and drop "
                f"rollout.custom.fsdp_sync.quantization ({topo.describe()})")
    try:
        check_engine(module, engine, full, topo, where=topo.describe())
    except ValueError as exc:
        return str(exc)
    return None

def verify_refusal(config: Any, sync: Any, engine: Any, topo: Any) -> str | None:
    """Why ``verify`` cannot check this SGLang server exactly, or None. With
    ``rollout.data_parallel_size`` > 1 verl starts SGLang with ``tp_size`` = tp x dp and
    ``dp_size`` = dp over tp x dp GPUs, i.e. attention data parallelism: attention is sharded
    over tp ranks and replicated across the dp groups, the rest over all tp x dp. The
    per-rank hashes `verify.SentToSGLang` computes follow plain tensor parallelism, so each
    rank's would differ from ``/weights_checker``'s (``fsdp-sync serve``'s full-tensor
    digests do not depend on it)."""
    dp = int(config.data_parallel_size)
    serves = getattr(engine, "serves_tensor_checksums", None)
    if dp <= 1 or not callable(serves) or serves():
        return None
    return (f"rollout.custom.fsdp_sync.verify={sync.verify!r} against SGLang with "
            f"rollout.data_parallel_size={dp}: verl serves the replica with SGLang's "
            f"tp_size={topo.tp_size} and dp_size={dp} (attention data parallelism: attention "
            f"sharded over {int(config.tensor_model_parallel_size)} rank(s), the rest over "
            f"{topo.tp_size}), and fsdp_sync computes SGLang's per-rank hashes for plain "
            f"tensor parallelism only, so it cannot check them; set "
            f"rollout.custom.fsdp_sync.verify=off, or rollout.data_parallel_size=1 "
            f"({topo.describe()})")
