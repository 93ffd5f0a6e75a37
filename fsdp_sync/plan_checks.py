"""What `fsdp_sync.plan` refuses before it counts a byte: a sync the planned engine would refuse
(or serve wrongly), in the words of the code that refuses it when the sync runs.

- SGLang takes no per-rank payloads outside the tensor method: ``layout="engine"`` with the
  distributed method (`SGLangEngine.accepts_distributed_rank_buckets` is false; the distributed
  transport refuses it before sending) or the disk method (it has no ``accepts_rank_checkpoints``;
  the disk transport refuses it before writing, `transport.disk_ranked.NO_RANK_CHECKPOINTS`);
- SGLang's own ``load_weights`` drops every block-FP8 scale of some models
  (`engines.sglang.refusals.scales_dropped`: a Llama model in FP8 through the disk or distributed
  method, or the tensor method's full tensors; the manager refuses the sync, `config_check`);
- SGLang serves some models other than the trainer computes them, whatever a sync sends
  (`engines.sglang.served_config.model_refusal`: a tied Qwen3-MoE / Qwen2-MoE / Mixtral, whose
  head SGLang keeps apart; the manager refuses the sync, `config_check.served_refusal`);
- the reference engine computes only what its forward knows
  (`engines.reference.tp_model.check_runnable`: silu, the default rope, full attention), as it and
  the bench refuse (e.g. Llama 3's rope scaling).

Not here: the memory fit (`plan._check_fit`), a TP/EP split the layout map refuses (the layout
map's own ValueError).
"""

from __future__ import annotations

from typing import Any

__all__ = ["engine_refusal"]


def engine_refusal(engine: str, method: str, layout: str, cfg: Any, spec: Any,
                   quantization: str | None = None) -> str | None:
    """Why ``engine`` ("sglang" or "reference") would refuse, or serve wrongly, a ``method`` sync
    with ``layout`` (and ``quantization``) of the model of Hugging Face config ``cfg`` (layout-map
    `ModelSpec` ``spec``); None where it runs it."""
    if engine == "sglang":
        from .engines.sglang import SGLangEngine
        from .engines.sglang.refusals import scales_dropped
        from .engines.sglang.served_config import model_refusal

        if layout == "engine" and method == "distributed" and not getattr(
                SGLangEngine, "accepts_distributed_rank_buckets", False):
            return ("SGLang does not accept per-rank buckets over the update group "
                    "(SGLangEngine.accepts_distributed_rank_buckets is false): its "
                    "update_weights_from_distributed broadcasts the same full tensors to every TP "
                    "rank; the distributed transport refuses layout='engine' for it before sending. "
                    "Plan --layout full, the tensor method's per-rank buckets, or --engine reference")
        if layout == "engine" and method == "disk" and not getattr(SGLangEngine, "accepts_rank_checkpoints", False):
            from .transport.disk_ranked import NO_RANK_CHECKPOINTS

            return (f"SGLang does not load per-rank files (SGLangEngine.accepts_rank_checkpoints is not "
                    f"true; the disk transport refuses layout='engine' for it before writing): "
                    f"{NO_RANK_CHECKPOINTS}. Plan --layout full (a Hugging Face checkpoint) or "
                    f"--engine reference")
        # per-rank tensor buckets reach SGLang through fsdp_sync's loader, which loads the scales
        own_loader = method != "tensor" or layout != "engine"
        return (scales_dropped(quantization, getattr(cfg, "model_type", None), own_loader=own_loader)
                or model_refusal(cfg))
    if engine == "reference":
        from .engines.reference.tp_model import check_runnable

        try:
            check_runnable(spec)
        except ValueError as exc:
            return f"{exc}; plan --engine sglang (SGLang computes it)"
    return None
