"""Audit H52 (wire format, plan bytes, model configs): in-process, no process launched.

- `wire.open_flattened_bucket` round-trips a bucket of mixed dtypes (FP8, bf16, float32, int64)
  byte for byte, through a longer reused buffer too, and refuses a malformed buffer with a
  ValueError naming what is wrong (a strided one escaped as torch's RuntimeError).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.wire import flattened_bucket, open_flattened_bucket, per_rank_bucket_plan

ENTRIES = [("a", torch.bfloat16, (3, 5)), ("b", torch.float32, (7,)), ("c", torch.float8_e4m3fn, (2, 3)),
           ("d", torch.int64, (2,))]


def _filled(bucket, extra: int = 0) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(0)
    src = {n: torch.randint(0, 256, (torch.Size(s).numel() * d.itemsize,), dtype=torch.uint8, generator=g)
           for n, d, s in ENTRIES}
    buf = torch.full((bucket.nbytes + extra,), 0xAB, dtype=torch.uint8)
    for e in bucket.entries:
        buf[e.start:e.end] = src[e.name]
    return buf, src


def test_a_mixed_bucket_round_trips_byte_for_byte_through_a_longer_reused_buffer():
    """Each entry at a 16-byte-aligned offset (`per_rank_bucket_plan`), read back as the bytes put
    there in its dtype and shape; a reused buffer longer than the bucket is cut to its bytes."""
    bucket = per_rank_bucket_plan(ENTRIES)
    assert [e.start % 16 for e in bucket.entries] == [0] * len(ENTRIES)
    for extra in (0, 37):
        buf, src = _filled(bucket, extra)
        payload = flattened_bucket(buf, bucket)
        assert payload["flattened_tensor"].numel() == bucket.nbytes
        out = open_flattened_bucket(payload)
        assert [n for n, _ in out] == [n for n, _, _ in ENTRIES]
        for (name, t), (_, dtype, shape) in zip(out, ENTRIES):
            assert t.dtype == dtype and tuple(t.shape) == shape, name
            assert torch.equal(t.contiguous().view(torch.uint8).reshape(-1), src[name]), name
    with pytest.raises(ValueError, match=f"cannot be read from a buffer of {bucket.nbytes - 1} bytes"):
        flattened_bucket(torch.zeros(bucket.nbytes - 1, dtype=torch.uint8), bucket)


def test_a_strided_buffer_is_refused_as_a_bad_bucket_not_a_torch_error():
    """A 1-D uint8 buffer whose stride is not 1 (every other byte of a larger one): torch refuses
    the bf16 view with a RuntimeError, which escaped `open_flattened_bucket`, whose callers take a
    ValueError as the refused payload. Refused now by name."""
    bucket = per_rank_bucket_plan(ENTRIES)
    buf, _ = _filled(bucket)
    payload = flattened_bucket(buf, bucket)
    wide = torch.zeros(2 * bucket.nbytes, dtype=torch.uint8)
    wide[::2] = buf
    with pytest.raises(ValueError, match="not contiguous"):
        open_flattened_bucket({"flattened_tensor": wide[::2], "metadata": payload["metadata"]})
    for bad, words in (({"metadata": payload["metadata"]}, "is a dict with 'flattened_tensor' and 'metadata'"),
                       ({"flattened_tensor": buf.view(1, -1), "metadata": payload["metadata"]}, "1-D uint8"),
                       ({"flattened_tensor": buf.view(torch.int8), "metadata": payload["metadata"]}, "1-D uint8"),
                       ({"flattened_tensor": buf[:-1], "metadata": payload["metadata"]}, "does not fit"),
                       ({"flattened_tensor": [1, 2], "metadata": payload["metadata"]}, "bad flattened bucket"),
                       ({"flattened_tensor": buf, "metadata": "x"}, "list of entries")):
        with pytest.raises(ValueError, match=words):
            open_flattened_bucket(bad)


def test_a_cluster_of_zero_or_negative_figures_is_refused_naming_the_field():
    """Every figure a plan divides by or fits into (GPUs, memory, each link's and the disk's
    bandwidth) must be > 0, the per-call and per-collective overheads and the measured costs
    >= 0: a 0 bandwidth divided the estimate by zero, a 0 memory refused every plan as not
    fitting, a negative latency priced a sync below its bytes. Each is refused naming the field
    and the value; 0 stays allowed where it means "not priced"."""
    from fsdp_sync.cluster import CLUSTERS, load_cluster

    good = CLUSTERS["h100-node"].to_dict()
    for f in ("gpus_per_node", "memory_per_gpu", "d2d_gbps", "intra_gbps", "inter_gbps",
              "disk_write_gbps", "disk_read_gbps"):
        for v in (0, -1):
            with pytest.raises(ValueError, match=f"cluster {f} must be > 0, got {v}"):
                load_cluster({**good, f: v})
    for f in ("call_s", "collective_s"):
        with pytest.raises(ValueError, match=f"call_s and collective_s must be >= 0"):
            load_cluster({**good, f: -1e-3})
        assert getattr(load_cluster({**good, f: 0}), f) == 0
    for f in ("cores", "touch_gbps", "map_gbps", "collective_gbps", "tensor_s", "bucket_s", "sync_s",
              "quantize_gbps", "quantize_tensor_s"):
        with pytest.raises(ValueError, match=f"cluster {f} must be >= 0"):
            load_cluster({**good, f: -1})
        assert getattr(load_cluster({**good, f: 0}), f) == 0
    for f, v, words in (("device", "tpu", "cluster device must be cuda or cpu, got 'tpu'"),
                        ("name", 7, "cluster name must be a string, got 7"),
                        ("source", None, "cluster source must be a string, got None")):
        with pytest.raises(ValueError, match=words):
            load_cluster({**good, f: v})


def test_a_tied_moe_model_is_refused_only_for_an_engine_that_serves_it_wrongly():
    """`config_check.served_refusal`: SGLang (no full-tensor digests) would serve a tied
    Qwen3-MoE with the head it was started with, so the manager refuses it; `fsdp-sync serve`
    behind SGLang's API (it has them) and the reference engine (no such call) serve the tie. Killed:
    the refusal made whatever the engine answers (every tied MoE model into `fsdp-sync serve`
    refused)."""
    import types

    from fsdp_sync.config_check import served_refusal

    def module(tie):        # a stand-in for a model and its config (only what the check reads)
        return types.SimpleNamespace(config=types.SimpleNamespace(
            model_type="qwen3_moe", tie_word_embeddings=tie, to_dict=dict))

    tied, untied = module(True), module(False)
    sglang = types.SimpleNamespace(serves_tensor_checksums=lambda: False)
    serve = types.SimpleNamespace(serves_tensor_checksums=lambda: True)
    assert "tie_word_embeddings=True for a 'qwen3_moe' model" in served_refusal(tied, sglang)
    assert served_refusal(tied, serve) is None
    assert served_refusal(tied, types.SimpleNamespace()) is None
    assert served_refusal(untied, sglang) is None


def test_a_models_config_is_found_through_nested_wrappers():
    """`config_check.model_config` looks through up to four wrappers (FSDP1's
    ``_fsdp_wrapped_module``, DDP-style ``module``), as the manager's module may be nested; the
    config then reaches every check (math keys, FP8 refusals). Killed: only the outer module
    looked at (a wrapped model's engine went unchecked)."""
    import types

    from fsdp_sync.config_check import math_key, model_config

    cfg = types.SimpleNamespace(model_type="qwen2", hidden_size=64, num_attention_heads=4, to_dict=dict)
    inner = types.SimpleNamespace(config=cfg)
    wrapped = types.SimpleNamespace(module=types.SimpleNamespace(_fsdp_wrapped_module=inner))
    assert model_config(wrapped) is cfg
    assert math_key(wrapped) == math_key(inner) and math_key(wrapped) is not None
    assert model_config(types.SimpleNamespace(module=types.SimpleNamespace())) is None


def test_check_config_refuses_each_size_at_its_boundary_naming_key_and_value():
    """`models.check_config` on a mapping (a config.json's fields): each count or size must be a
    positive integer (1 is the least, 0 refused), a shared expert's width >= 0, the top-k at most
    the experts (equal passes, one more refused), heads grouped over the key/value heads, and
    without a head_dim hidden_size >= heads. Killed: each boundary moved by one."""
    from fsdp_sync.models import SIZE_KEYS, check_config

    base = dict(vocab_size=8, hidden_size=8, num_attention_heads=4, num_key_value_heads=2)
    check_config(base)
    for key in SIZE_KEYS:
        check_config({**base, "num_attention_heads": 1, "num_key_value_heads": 1, key: 1})
        for v in (0, -2, True, 2.0, "4"):
            with pytest.raises(ValueError, match=f"src: {key} must be a positive integer, got {v!r}"):
                check_config({**base, key: v}, "src")
    check_config({**base, "shared_expert_intermediate_size": 0})
    with pytest.raises(ValueError, match="shared_expert_intermediate_size must be an integer >= 0 .*got -1"):
        check_config({**base, "shared_expert_intermediate_size": -1})
    for experts in ("num_experts", "num_local_experts"):
        check_config({**base, experts: 4, "num_experts_per_tok": 4})
        with pytest.raises(ValueError, match=f"num_experts_per_tok must be at most {experts} \\(4\\), got 5"):
            check_config({**base, experts: 4, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="num_attention_heads 4, num_key_value_heads 3"):
        check_config({**base, "num_key_value_heads": 3})
    check_config({**base, "hidden_size": 4})                     # head_dim 1
    with pytest.raises(ValueError, match=r"hidden_size // num_attention_heads = 3 // 4 = 0"):
        check_config({**base, "hidden_size": 3})
    check_config({**base, "hidden_size": 3, "head_dim": 2})      # a head_dim of its own: no division


def test_a_checkpoints_config_json_states_the_saved_dtype_under_both_names_and_fp8s_ignored_layers():
    """`models.hf_config_json`: the saved tensors' dtype under ``dtype`` and, where the config has
    it, transformers 4's ``torch_dtype`` (an engine reading the older name would otherwise load
    bf16 tensors as the trainer's float32); with ``quantization="fp8"`` SGLang's block-FP8
    ``quantization_config`` carrying the layers the config leaves unquantized. Killed: the older
    name left stale, the ignored layers dropped (an engine would read their bf16 bytes as FP8)."""
    import json
    import types

    from fsdp_sync.models import hf_config_json

    class Cfg:
        def __init__(self, **d):
            self.d = d

        def to_json_string(self, use_diff=True):
            return json.dumps(self.d)

    own = {"quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ["model.layers.0.mlp.down_proj"]}
    module = types.SimpleNamespace(config=Cfg(model_type="qwen2", torch_dtype="float32", quantization_config=own))
    d = hf_config_json(module, torch.bfloat16, "fp8")
    assert (d["dtype"], d["torch_dtype"]) == ("bfloat16", "bfloat16")
    assert d["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128],
                                       "ignored_layers": ["model.layers.0.mlp.down_proj"]}
    plain = hf_config_json(types.SimpleNamespace(config=Cfg(model_type="qwen2")), torch.float16)
    assert plain == {"model_type": "qwen2", "dtype": "float16"}
    assert hf_config_json(types.SimpleNamespace(), torch.float16) is None


def test_a_family_default_that_cannot_build_the_model_is_refused_saying_it_is_the_default():
    """`models.load_config` checks the config again with the family's defaults for the keys a
    mapping leaves out: a Mixtral of 4 heads that gives no key/value heads gets transformers' 8,
    a Qwen3-MoE of 2 experts its top-8. Refused, saying the value is the family's default (the
    file gave none). Killed: the second check dropped (such a config built, or failed inside
    transformers' or torch's code)."""
    from fsdp_sync.models import load_config

    base = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"mixtral's defaults for the keys it leaves out\): num_attention_heads "
                                         r"must be a multiple of num_key_value_heads .*num_key_value_heads 8"):
        load_config({**base, "model_type": "mixtral"})
    with pytest.raises(ValueError, match=r"qwen3_moe's defaults .*num_experts_per_tok must be at most "
                                         r"num_experts \(2\), got 8"):
        load_config({**base, "model_type": "qwen3_moe", "num_experts": 2})
    assert load_config({**base, "model_type": "mixtral", "num_key_value_heads": 2}).num_key_value_heads == 2


CPU = dict(name="cpu-test", device="cpu", gpus_per_node=64, memory_per_gpu=10**12, d2d_gbps=5.0, intra_gbps=1.0,
           inter_gbps=1.0, disk_write_gbps=1.0, disk_read_gbps=1.0, call_s=1e-4, collective_s=1e-4)


def _busiest_writer(model: str, tp: int, writers: int, bucket: int, everywhere: bool) -> tuple[int, int]:
    """What the busiest trainer rank of a per-rank disk sync quantizes, by
    `transport.disk_ranked.write_rank_buckets`'s rule: engine rank i's file of bucket k is cut,
    quantized and written by ``writers[i % W]`` on the all-to-all path, ``writers[(k * tp + i) % W]``
    where every rank sees every buffer. (bytes in the rollout dtype, quantized tensors)."""
    from fsdp_sync.plan import meta_model
    from fsdp_sync.weights import reshard
    from fsdp_sync.weights.fp8_config import held_layout
    from fsdp_sync.weights.layout import layout_for
    from fsdp_sync.weights.quantize import StreamQuantizer

    cfg, _ = meta_model(model)
    lay = layout_for(cfg, tp)
    quant = StreamQuantizer(held_layout(cfg, lay, "fp8"))
    load = [[0, 0] for _ in range(writers)]
    for k, b in enumerate(reshard.plan_rank_buckets(lay, torch.bfloat16, bucket)):
        for i in range(tp):
            w = (k * tp + i) % writers if everywhere else i % writers
            load[w][0] += sum(e.end - e.start for e in b.entries)
            load[w][1] += sum(e.name in quant.engine for e in b.entries)
    return max(x[0] for x in load), max(x[1] for x in load)


def test_per_rank_disk_files_all_to_all_is_planned_with_the_transports_owners():
    """Per-rank disk files on the all-to-all path (several trainer ranks, no host-shared buffer):
    engine rank i's buffer is assembled on trainer rank i mod W (`disk_ranked`'s ``owners``), so
    at 3 trainer ranks and TP 4 rank 0 receives two engine ranks' pieces and quantizes two engine
    ranks' buckets (ceil(4 / 3), not 4 // 3). The plan's trainer_rank_bytes_in is the exchange's
    busiest rank with those owners, and its quantizer load the busiest writer's. Killed: every
    buffer owned by rank 0, and the writers' share rounded down."""
    from fsdp_sync.plan import Cluster, PlanJob, meta_model, plan_row
    from fsdp_sync.plan_bytes import fsdp_counts
    from fsdp_sync.weights import reshard
    from fsdp_sync.weights.layout import layout_for

    ranks, tp, bucket = 3, 4, 64 << 10
    row = plan_row(PlanJob("tiny-fp8", "disk", "engine", bucket, "bfloat16", "fp8", ranks, 2, tp,
                           engine="reference", share_host_memory=False), Cluster(**CPU))
    assert row["reshard_path"] == "all-to-all"
    cfg, module = meta_model("tiny-fp8")
    counts = fsdp_counts(module, ranks, 2)
    ins = reshard.exchange_bytes(layout_for(cfg, tp), 2, counts, [[i % ranks] for i in range(tp)])
    assert row["trainer_rank_bytes_in"] == max(i for i, _ in ins) > 0
    assert (row["quantize_bytes_in"], row["quantized_tensors"]) == _busiest_writer("tiny-fp8", tp, ranks, bucket, False)


@pytest.mark.timeout(60)
def test_a_member_joining_a_called_off_update_group_fails_at_once_saying_why():
    """`wire.call_off_join`: trainer rank 0 gave the group up before every member joined and marked
    its store; a member that `new_update_group` connects afterwards fails at once with the reason,
    instead of waiting in a rendezvous that cannot complete until its timeout. Killed: the mark
    not read (the member waited out its timeout and failed without the reason)."""
    import torch.distributed as dist

    from fsdp_sync.wire import call_off_join, host_store, new_update_group

    store = host_store(2, 30)
    call_off_join(store, "h52_group", "trainer rank 0 failed making it: boom")
    with pytest.raises(dist.DistNetworkError, match=r"update group 'h52_group' at 127.0.0.1:\d+: its rank 0 "
                                                     r"called the join off \(trainer rank 0 failed making it: boom\)"):
        new_update_group(backend="gloo", master_address="127.0.0.1", master_port=store.port, world_size=2,
                         rank=1, group_name="h52_group", timeout_s=3)


def test_fsdp1_units_are_the_trainers_wrapping_one_per_decoder_layer_and_the_root():
    """`plan_bytes.fsdp1_unit_numels`: the CLI's FSDP1 trainer wraps every module of the model's
    decoder-layer class (`cli.trainer.wrap_fsdp`'s ``ModuleWrapPolicy``) and the root, so each
    unit's flat parameter (what torch pads to a multiple of the world and all-gathers for a state
    dict) is one layer's parameters, and the root's everything else, a tied embedding once. Killed:
    the layers not found (one unit of the whole model: other padding, other counts)."""
    from fsdp_sync.cli.trainer import decoder_layer_cls
    from fsdp_sync.plan import meta_model
    from fsdp_sync.plan_bytes import fsdp1_unit_numels

    for name in ("tiny", "tiny-tied", "tiny-qwen3-moe"):
        _, module = meta_model(name)
        cls = decoder_layer_cls(module)
        layers = [m for m in module.modules() if isinstance(m, cls)]
        in_layers = {id(p) for m in layers for p in m.parameters()}
        root = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values() if id(p) not in in_layers)
        want = [sum(p.numel() for p in m.parameters()) for m in layers] + [root]
        assert len(layers) == module.config.num_hidden_layers and fsdp1_unit_numels(module) == want, name


@pytest.mark.parametrize("ranks,tp", [(4, 2), (3, 4)])
def test_per_rank_disk_files_host_shared_are_planned_with_the_transports_writers(ranks, tp):
    """Per-rank disk files where every trainer rank sees every buffer (host-shared): bucket k of
    engine rank i is quantized and written by trainer rank (k tp + i) mod W
    (`disk_ranked.write_rank_buckets`), which spreads the load; the plan counted ceil(tp / W) of
    one engine rank's buckets for the busiest writer, the all-to-all path's rule (1.75x too high
    at 4 ranks TP 2, 1.45x at 3 ranks TP 4; H52's audit)."""
    from fsdp_sync.plan import Cluster, PlanJob, plan_row

    bucket = 64 << 10
    row = plan_row(PlanJob("tiny-fp8", "disk", "engine", bucket, "bfloat16", "fp8", ranks, 2, tp,
                           engine="reference", share_host_memory=True), Cluster(**CPU))
    assert row["reshard_path"] == "host-shared"
    assert (row["quantize_bytes_in"], row["quantized_tensors"]) == _busiest_writer("tiny-fp8", tp, ranks, bucket, True)
