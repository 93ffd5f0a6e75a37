"""What verl 0.9.1 hands fsdp_sync's adapter, checked on verl's own classes (`make test-verl`).

Each case here killed a mutant no other test did (stop 74, H42):

- ``rollout.name=fsdp_sync_ref`` with no ``custom.fsdp_sync.enable``: verl's rollout registry gives
  fsdp_sync's adapter, never verl's SGLang ``ServerAdapter`` (nothing else can sync fsdp-sync serve);
- ``rollout.disaggregation.enabled=true`` (verl's ``DisaggregationConfig``) is refused when the
  adapter is built, naming verl's key;
- a bad value of an honoured ``custom.fsdp_sync.*`` key is refused naming the key as the user wrote
  it (``rollout.custom.fsdp_sync.strategy``), not SyncConfig's bare field name;
- verl's ``PPOTrainer._consume_sync_metrics``, wrapped by `metrics.install`, keeps what verl itself
  stashed (the delta engines' figures) beside fsdp_sync's, and a failing drain fails no step.
"""

from __future__ import annotations

import types

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]


def _config(**over):
    import verl  # noqa: F401  (the plug-in)
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    cfg = {"name": "sglang", "dtype": "bfloat16", "free_cache_engine": True,
           "tensor_model_parallel_size": 1, **over}
    return omega_conf_to_dataclass(OmegaConf.create(cfg), RolloutConfig)


def _build(config):
    from verl.workers.rollout.base import get_rollout_class

    return get_rollout_class(config.name, config.mode)(
        config=config, model_config=types.SimpleNamespace(hf_config=None), device_mesh=None)


def test_fsdp_sync_ref_builds_fsdp_syncs_adapter_without_the_opt_in():
    from fsdp_sync.integrations.verl import SGLangAdapter

    built = _build(_config(name="fsdp_sync_ref"))
    assert type(built) is SGLangAdapter
    # the same config under rollout.name=sglang, not opted in: verl's own adapter
    from fsdp_sync.integrations.verl import enabled

    assert enabled(_config(name="fsdp_sync_ref")) and not enabled(_config())


def test_prefill_decode_disaggregation_is_refused_when_built_naming_verls_key():
    on = dict(custom={"fsdp_sync": {"enable": True, "base_url": "http://127.0.0.1:9"}})
    config = _config(disaggregation={"enabled": True, "transfer_backend": "fake"}, **on)
    assert config.disaggregation.enabled is True      # verl's DisaggregationConfig, coerced
    with pytest.raises(NotImplementedError, match=r"rollout\.disaggregation\.enabled"):
        _build(config)
    assert type(_build(_config(**on))).__name__ == "SGLangAdapter"


@pytest.mark.parametrize("key, value", [("strategy", "fast"), ("verify", True), ("bucket_bytes", "12"),
                                        ("dist_timeout_s", -1), ("share_host_memory", "maybe")])
def test_a_bad_honoured_option_is_refused_naming_it_as_written_under_verl(key, value):
    from fsdp_sync.integrations.verl import sync_config

    config = _config(custom={"fsdp_sync": {"enable": True, key: value}})
    with pytest.raises(ValueError, match=rf"^rollout\.custom\.fsdp_sync\.{key} must .*{value!r}"):
        sync_config(config)


def test_verls_own_pending_sync_metrics_are_kept_beside_fsdp_syncs(monkeypatch, caplog):
    import verl  # noqa: F401  (installs the import hook)
    from verl.trainer.ppo.v1 import trainer_base

    from fsdp_sync.integrations.verl import metrics

    consume = trainer_base.PPOTrainer._consume_sync_metrics
    assert getattr(consume, "_fsdp_sync", False)          # patched when verl imported it
    monkeypatch.setattr(metrics, "drain", lambda: {"fsdp_sync/sync_s": 0.5})
    trainer = types.SimpleNamespace(_pending_sync_metrics={"delta/changed_ratio": 0.25})
    assert consume(trainer) == {"delta/changed_ratio": 0.25, "fsdp_sync/sync_s": 0.5}
    assert trainer._pending_sync_metrics == {}            # verl's own drain still ran

    def broken():
        raise ConnectionError("sink gone")

    monkeypatch.setattr(metrics, "drain", broken)
    trainer._pending_sync_metrics = {"delta/changed_ratio": 0.5}
    assert consume(trainer) == {"delta/changed_ratio": 0.5}
    assert "sink gone" in caplog.text


def test_release_keeps_the_base_weights_of_a_lora_run_served_as_an_adapter():
    """verl's worker never resumes ``weights`` where ``sleep_level`` is 1 (a LoRA adapter run):
    a release of them too would leave SGLang generating from released weights. The adapter
    releases the KV cache only there, everything otherwise, and nothing without free_cache_engine."""
    import asyncio

    from verl.workers.rollout.base import get_rollout_class

    posted = []

    class Engine:
        def release_memory_occupation(self, tags):
            posted.append(tags)

    async def client():
        return Engine()

    on = dict(custom={"fsdp_sync": {"enable": True, "base_url": "http://127.0.0.1:9"}})
    for lora_rank, free, want in ((8, True, [["kv_cache"]]), (0, True, [["kv_cache", "weights"]]),
                                  (8, False, [])):
        config = _config(free_cache_engine=free, **on)
        rollout = get_rollout_class(config.name, config.mode)(
            config=config, model_config=types.SimpleNamespace(hf_config=None, lora_rank=lora_rank),
            device_mesh=None)
        assert rollout.sleep_level == (1 if lora_rank else 2)
        rollout._client = client
        posted.clear()
        asyncio.run(rollout.release())
        assert posted == want, (lora_rank, free, posted)


def test_enable_written_as_text_is_read_as_yaml_and_the_cli_write_it():
    """An ``${oc.env:...}`` interpolation hands ``enable`` over as text: "1"/"True" opt in,
    "0"/"false" do not; anything else is refused naming the key and the value."""
    from fsdp_sync.integrations.verl import enabled

    def cfg(v):
        return {"name": "sglang", "custom": {"fsdp_sync": {"enable": v}}}

    assert [enabled(cfg(v)) for v in ("1", "True", True, "0", "false", False)] == [True] * 3 + [False] * 3
    with pytest.raises(ValueError, match=r"rollout\.custom\.fsdp_sync\.enable must be true or false, got 'yes'"):
        enabled(cfg("yes"))


def test_an_fp8_syncs_quantizer_seconds_are_their_own_figure_not_transports():
    """``transport_s`` is the rest of the sync (handles, gather, the engine's calls): the FP8
    quantizer's seconds (``quantize_s``) were counted in it too, so the phases summed past
    ``sync_s``. They are disjoint parts of the sync, so they now sum to at most ``sync_s``, and
    ``quantize_s`` reaches verl's step metrics (slowest replica)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fake_sglang
    import verl_ranks

    from fsdp_sync.cli.launch import run_ranks
    from fsdp_sync.integrations.verl.metrics import step_metrics

    cfg = {"_target_": "verl.workers.config.RolloutConfig", "name": "sglang", "dtype": "bfloat16",
           "free_cache_engine": True, "quantization": "fp8", "tensor_model_parallel_size": 1,
           "checkpoint_engine": {"update_weights_bucket_megabytes": 1},
           "custom": {"fsdp_sync": {"enable": True}}}
    with fake_sglang.FakeSGLangServer(tp_size=1) as server:
        cfg["custom"]["fsdp_sync"]["base_url"] = server.url
        st = run_ranks(verl_ranks.sync_fp8_tiny, 1, cfg, "qwen2", None, timeout_s=100)[0]
        got = dict(server.engine.weights)
    assert st["quantized_tensors"] == 14 and st["quantize_s"] > 0, st
    # the values: the trainer's float32 weights cast to rollout.dtype, then quantized (as verl's
    # quantizer casts before it quantizes); quantized from float32 the scales differ
    import torch

    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import fp8

    trained = build_model(load_config("tiny-fp8", model_type="qwen2"), seed=7).state_dict()
    differs = 0
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        q, sc = fp8.quantize_block(n, trained[n].to(torch.bfloat16))
        assert got[n].view(torch.uint8).equal(q.view(torch.uint8)) and got[n + "_scale_inv"].equal(sc), n
        differs += not fp8.quantize_block(n, trained[n])[1].equal(sc)
    assert differs, "the cast changes no scale here: the check above cannot fail"
    parts = sum(st[k] for k in ("export_s", "pack_s", "digest_s", "quantize_s", "transport_s"))
    assert parts <= st["sync_s"] * (1 + 1e-9), st
    m = step_metrics([dict(st, global_steps=1, kind="full"), dict(st, global_steps=1, kind="full",
                                                                  quantize_s=st["quantize_s"] / 2)])
    assert m["fsdp_sync/quantize_s"] == st["quantize_s"], m


def test_fsdp_sync_options_without_enable_are_refused_not_ignored():
    """``+...custom.fsdp_sync.verify=full`` without ``enable``: verl's own adapter ran, reading none
    of them (no check while the user asked for one). Refused naming the keys; ``enable=false``
    says the user means verl's adapter, and ``fsdp_sync_ref`` needs no opt-in."""
    from fsdp_sync.integrations.verl import enabled

    with pytest.raises(ValueError, match=r"rollout\.custom\.fsdp_sync sets \['bucket_mb', 'verify'\] "
                                         r"but not enable.*fsdp_sync\.enable=true"):
        _build(_config(custom={"fsdp_sync": {"verify": "full", "bucket_mb": 4}}))
    assert not enabled(_config(custom={"fsdp_sync": {"enable": False, "verify": "full"}}))
    assert enabled(_config(name="fsdp_sync_ref", custom={"fsdp_sync": {"log_dir": "/tmp"}}))
    assert not enabled(_config(custom={"fsdp_sync": {}}))


def test_a_run_not_opted_in_builds_the_class_registered_before_fsdp_sync(monkeypatch):
    """`adapter.register` keeps what ``("sglang", "async")`` named before it (another plug-in's
    adapter, say); a run that does not opt in builds that class, with verl's arguments, not verl's
    own ServerAdapter."""
    import sys

    from verl.workers.rollout import base

    from fsdp_sync.integrations.verl import adapter

    built = []

    class Theirs:
        def __init__(self, config, model_config, device_mesh, replica_rank=-1):
            built.append((model_config, device_mesh, replica_rank))

    stub = types.ModuleType("h42_other_plugin")
    stub.Theirs = Theirs
    monkeypatch.setitem(sys.modules, "h42_other_plugin", stub)
    monkeypatch.setattr(adapter, "VERL_DEFAULT", adapter.VERL_DEFAULT)
    monkeypatch.setitem(base._ROLLOUT_REGISTRY, adapter.KEY, "h42_other_plugin.Theirs")
    adapter.register()
    assert base._ROLLOUT_REGISTRY[adapter.KEY] == adapter.OURS
    assert adapter.VERL_DEFAULT == "h42_other_plugin.Theirs"
    obj = base.get_rollout_class("sglang", "async")(config=_config(), model_config="mc",
                                                    device_mesh="mesh", replica_rank=3)
    assert type(obj) is Theirs and built == [("mc", "mesh", 3)]


def test_a_stream_that_failed_is_not_pulled_again():
    """`stream.pulled_in_a_thread`: where verl's receiver itself raised (a broadcast that timed
    out, say), its error is raised and the stream is not walked again: a second pull would wait
    out the receiver's timeout once more. (A consumer's failure still walks the rest: `drained`.)"""
    import asyncio

    from fsdp_sync.integrations.verl.stream import pulled_in_a_thread

    class Receiver:                      # an async iterator, not a generator: it can be pulled again
        pulls = 0

        def __aiter__(self):
            return self

        async def __anext__(self):
            Receiver.pulls += 1
            if Receiver.pulls == 1:
                raise TimeoutError("broadcast of bucket 0 timed out")
            await asyncio.sleep(0)       # what a real receiver would wait out again
            raise TimeoutError(f"pull {Receiver.pulls}")

    with pytest.raises(TimeoutError, match="bucket 0"):
        asyncio.run(pulled_in_a_thread(Receiver(), lambda it: list(it)))
    assert Receiver.pulls == 1


def test_what_each_replica_publishes_and_how_a_step_combines_it(monkeypatch):
    """`metrics.publish` (infer-TP rank 0 of each replica): every figure of `KEYS`, ints
    (bytes, tensors, buckets) as much as floats, and the sync's kind (a LoRA run's adapter);
    `step_metrics` of two replicas: seconds of the slowest, counts summed (buckets too)."""
    import asyncio

    import ray

    from fsdp_sync.integrations.verl import metrics

    put = []

    class Sink:
        class put:                       # noqa: N801 - Ray's actor-method shape: put.remote(x)
            @staticmethod
            def remote(record):
                put.append(record)
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(None)
                return fut

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(metrics, "_sink", lambda: Sink)
    for sync_s, bucket_count in ((0.5, 3), (0.75, 4)):
        stats = {"kind": "adapter", "global_steps": 2, "strategy": "flattened", "sync_s": sync_s,
                 "export_s": 0.125, "bytes": 1000, "tensors": 12, "buckets": bucket_count,
                 "engine_calls": bucket_count, "digests": {"w": "abc"}}
        asyncio.run(metrics.publish(stats))
    assert put[0] == {"sync_s": 0.5, "export_s": 0.125, "bytes": 1000.0, "tensors": 12.0,
                      "buckets": 3.0, "engine_calls": 3.0, "global_steps": 2, "kind": "adapter"}
    m = metrics.step_metrics(put)
    assert (m["fsdp_sync/sync_s"], m["fsdp_sync/bytes"], m["fsdp_sync/buckets"],
            m["fsdp_sync/engine_calls"], m["fsdp_sync/replicas"], m["fsdp_sync/adapter"]) == \
        (0.75, 2000.0, 7.0, 7.0, 2.0, 1.0), m


def test_an_ignored_list_on_mixtral_is_compared_only_where_verls_quantizer_quantizes(monkeypatch):
    """Mixtral's experts (w1/w2/w3): SGLang builds them FP8, verl's own pattern never quantizes
    them (a verl/SGLang difference that has nothing to do with the ignored list). An ignored
    attention on such a model is taken: the comparison with verl's quantizer covers the tensors
    both quantize by default, and the experts still travel FP8 as SGLang holds them."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.integrations.verl import fp8_ignored
    from fsdp_sync.models import load_config

    monkeypatch.delenv(fp8_ignored.ENV, raising=False)
    hf = load_config("tiny-fp8", model_type="mixtral")
    hf.quantization_config = {"ignored_layers": ["model.layers.0.self_attn"]}
    ignored = fp8_ignored.ignored_layers("sglang", hf)
    quant = fp8_ignored.quantizer("sglang", hf, SyncConfig(quantization="fp8"), 1, ignored)
    assert "model.layers.0.self_attn.q_proj.weight" not in quant.hf
    assert "model.layers.1.self_attn.q_proj.weight" in quant.hf
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in quant.hf


def test_the_memory_calls_leave_the_workers_event_loop_free():
    """verl awaits its own adapter's memory calls; ours ran SGLang's HTTP calls on the worker's
    event loop, which then answered nothing else until the server did. Here the engine's call
    returns only once another coroutine on the same loop has run: it did not before (the call
    waited out its 10 s and said so)."""
    import asyncio
    import threading

    from verl.workers.rollout.base import get_rollout_class

    ran = threading.Event()
    seen = []

    class Engine:
        def _call(self, tags):
            seen.append((tags, ran.wait(10)))

        release_memory_occupation = resume_memory_occupation = _call

    async def client():
        return Engine()

    async def both(call):
        async def other():
            ran.set()

        await asyncio.gather(call, other())

    config = _config(custom={"fsdp_sync": {"enable": True, "base_url": "http://127.0.0.1:9"}})
    rollout = get_rollout_class(config.name, config.mode)(
        config=config, model_config=types.SimpleNamespace(hf_config=None, lora_rank=0), device_mesh=None)
    rollout._client = client
    for call in (lambda: rollout.release(), lambda: rollout.resume(["weights"])):
        ran.clear()
        asyncio.run(both(call()))
    assert seen == [(["kv_cache", "weights"], True), (["weights"], True)], seen
