"""What fsdp_sync's verl adapter takes from its options, and what its flattened packing sends
(`make test-verl`).

- ``custom.fsdp_sync.*``: only the SyncConfig fields the adapter honours are taken; the others
  (accepted and then ignored before: ``method=disk`` synced by tensor) are refused naming the verl
  option that decides them; ``bucket_mb`` is read as every MiB figure is (`config.mib_to_bytes`,
  naming the key) and not together with ``bucket_bytes``.
- The flattened packing (`stream.BucketBuffer`) with sizes that are not multiples of the 16-byte
  alignment: bucket_mb=0.1, an odd tensor larger than its bucket, an odd bf16 tensor over 1 MiB;
  each payload, opened as the engine opens it, holds the tensors bit for bit.
- ``base_url`` beside verl's own server actor (the one its agent loop generates from) is refused
  naming both; the same server under another spelling is synced and told the step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def _rollout(**fs) -> dict:
    return {"name": "sglang", "dtype": "bfloat16", "free_cache_engine": True,
            "checkpoint_engine": {"update_weights_bucket_megabytes": 2048},
            "custom": {"fsdp_sync": dict(enable=True, **fs)}}


IGNORED_BEFORE = {"method": "disk", "disk_dir": "/tmp/x", "layout": "engine", "pause_mode": "abort",
                  "free_cache_engine": False, "pipelined": True}


@pytest.mark.parametrize("key", sorted(IGNORED_BEFORE))
def test_a_syncconfig_field_the_adapter_does_not_honour_is_refused_naming_verls_option(key):
    from fsdp_sync.integrations.verl import sync_config

    with pytest.raises(ValueError, match=f"does not honour '{key}'") as err:
        sync_config(_rollout(**{key: IGNORED_BEFORE[key]}))
    instead = {"method": "checkpoint_engine.backend", "free_cache_engine":
               "actor_rollout_ref.rollout.free_cache_engine", "pause_mode": "verl pauses"}
    if key in instead:
        assert instead[key] in str(err.value), err.value


def test_every_syncconfig_field_is_honoured_or_refused_and_the_honoured_ones_are_taken():
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.integrations.verl import options, sync_config

    fields = {f.name for f in dataclasses.fields(SyncConfig)}
    assert set(options.HONOURED) | set(options.INSTEAD) == fields
    assert not set(options.HONOURED) & set(options.INSTEAD)
    s = sync_config(dict(_rollout(strategy="bucketed", bucket_bytes=4096, dtype="float32",
                                  verify="sample", dist_timeout_s=7, share_host_memory=False),
                         dtype="float32"))     # rollout.dtype agrees (test_h4_rollout_dtype)
    assert (s.strategy, s.bucket_bytes, s.dtype, s.verify, s.dist_timeout_s,
            s.share_host_memory) == ("bucketed", 4096, torch.float32, "sample", 7, False)
    # a quantization other than rollout.quantization: only for a server of the user's own
    assert sync_config(_rollout(quantization="fp8", base_url="http://127.0.0.1:9")).quantization == "fp8"
    with pytest.raises(ValueError, match="bucket_megs"):
        sync_config(_rollout(bucket_megs=3))


def test_rollout_dtype_auto_is_what_sglang_serves_the_actors_model_in():
    """verl2 audit, item 5: verl hands ``rollout.dtype`` to SGLang as written; ``half``, ``float``
    and ``auto`` (SGLang: the model config's dtype, float16 for a float32 one) were refused. The
    adapter resolves ``auto`` from verl's ``model_config.hf_config``, ``custom.fsdp_sync.dtype``
    too; the fsdp_sync_ref replica serves the same dtype."""
    import json
    import tempfile
    import types

    from fsdp_sync.integrations.verl import sync_config
    from fsdp_sync.integrations.verl.replica import serve_command
    from fsdp_sync.models import load_config

    hf = load_config("tiny")             # float32: SGLang serves it in float16
    assert sync_config(dict(_rollout(), dtype="auto"), hf).dtype == torch.float16
    assert sync_config(dict(_rollout(), dtype="half")).dtype == torch.float16
    assert sync_config(dict(_rollout(dtype="auto"), dtype="float16"), hf).dtype == torch.float16
    with pytest.raises(ValueError, match=r"rollout\.custom\.fsdp_sync\.dtype='auto' is the dtype SGLang reads"):
        sync_config(_rollout(dtype="auto"))
    rollout = dict(_rollout(), dtype="auto", tensor_model_parallel_size=1, data_parallel_size=1,
                   pipeline_model_parallel_size=1)
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump({"model_type": "qwen2"}, f)
        cmd = serve_command(rollout, types.SimpleNamespace(local_path=d, hf_config=hf))
    assert cmd[cmd.index("--dtype") + 1] == "float16"


@pytest.mark.parametrize("value, match", [
    ("64MB", "must be a positive number of MiB, got '64MB'"),
    (1e-9, "must be at least 1 byte"),
    (-1, "must be a positive number of MiB, got -1"),
    (float("nan"), "must be a positive number of MiB, got nan"),
])
def test_a_bad_bucket_mb_is_refused_naming_the_key(value, match):
    from fsdp_sync.integrations.verl import sync_config

    with pytest.raises(ValueError, match=r"rollout\.custom\.fsdp_sync\.bucket_mb " + match):
        sync_config(_rollout(bucket_mb=value))


def test_bucket_mb_is_read_as_mib_and_not_together_with_bucket_bytes():
    from fsdp_sync.integrations.verl import sync_config

    assert sync_config(_rollout(bucket_mb=0.1)).bucket_bytes == int(0.1 * 2**20)
    assert sync_config(_rollout(bucket_mb="3")).bucket_bytes == 3 << 20
    with pytest.raises(ValueError, match="give bucket_mb or bucket_bytes, not both"):
        sync_config(_rollout(bucket_mb=64, bucket_bytes=1024))


# --------------------------------------------------------------------------- unaligned buckets

@pytest.mark.parametrize("bucket_bytes, tensors", [
    # 400 B + 104456 B = 104856 B fit a 104857 B bucket, but padded to 16 B they need 104864
    (int(0.1 * 2**20), [("a", torch.arange(100.0)), ("b", torch.arange(26114.0) - 7.5)]),
    # 20 B, larger than its 16 B bucket: a buffer of its own, padded to 32 B
    (16, [("w", torch.arange(5.0) + 0.25)]),
    # 2000002 B of bf16 over a 1 MiB bucket, then small odd tensors around it
    (1 << 20, [("s", torch.arange(3.0)),
               ("w", torch.linspace(-3, 3, 1000001, dtype=torch.bfloat16)),
               ("t", torch.arange(7, dtype=torch.int32))]),
], ids=["bucket_mb_0.1", "odd_tensor_over_bucket", "odd_bf16_over_1mib"])
def test_unaligned_sizes_are_packed_and_sent_bit_for_bit(bucket_bytes, tensors):
    """Before: the first case raised 'too many values to unpack' (the buffer accepted what the
    bucket plan split in two), the others 'a flattened bucket of 32 bytes cannot be read from a
    buffer of 20 bytes' (the buffer was sized to the unpadded end)."""
    import types

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.integrations import verl as plugin
    from fsdp_sync.transport import SyncStats
    from fsdp_sync.weights import handles
    from fsdp_sync.wire import open_flattened_bucket

    a = object.__new__(plugin.SGLangAdapter)     # its __new__ reads a verl config
    a.sync, a._buffer_hint, a._pack_s, a._digest_s = SyncConfig(bucket_bytes=bucket_bytes), 0, 0.0, 0.0
    a._ipc_device, a._sent = None, None
    topo = types.SimpleNamespace(tp_size=1, tp_rank=0)
    got = {}
    for call in a._flattened_calls(iter(tensors), topo, SyncStats()):
        received = handles.open_payload(call.wire, 0)
        for name, t in open_flattened_bucket(received.value):
            got[name] = t.clone()
        del received
        for ps in call.sets:
            ps.release(require_ack=False)
        call.on_release()
    assert list(got) == [n for n, _ in tensors]
    for name, t in tensors:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


# --------------------------------------------------------------------------- base_url

def _base_url_beside_verls_server(rank, world, verl_url, other_url):
    """One trainer rank (TP 1) with Ray and a stand-in of verl's server actor
    (``sglang_server_0_0``, serving ``verl_url``)."""
    import ray
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    import verl_ranks
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.models import build_model, load_config

    @ray.remote(num_cpus=0)
    class Server:        # the weight-sync surface of verl's SGLangHttpServer
        def __init__(self, host, port):
            self.address, self.steps = (host, port), []

        def get_server_address(self):
            return self.address

        def set_global_steps(self, step):
            self.steps.append(step)

        def got(self):
            return self.steps

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        host, port = verl_url.split("://")[1].rsplit(":", 1)
        actor = Server.options(name="sglang_server_0_0").remote(host, int(port))
        model = wrap_fsdp(build_model(load_config("tiny"), seed=0), 2)
        mesh = init_device_mesh("cpu", mesh_shape=(1, 1, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])
        out = {}
        for label, url in (("beside", other_url), ("same", f"http://localhost:{port}")):
            cfg = _rollout(base_url=url)
            cfg.update(tensor_model_parallel_size=1, dtype="float32")
            rollout = get_rollout_class("sglang", "async")(
                config=omega_conf_to_dataclass(OmegaConf.create(cfg), RolloutConfig),
                model_config=None, device_mesh=mesh)

            async def sync():
                await rollout.resume(tags=["weights"])
                await rollout.update_weights(verl_ranks.verl_generator(model), global_steps=7)

            try:
                asyncio.run(sync())
                out[label] = "synced"
            except Exception as exc:  # noqa: BLE001 - the refusal is the result
                out[label] = f"{type(exc).__name__}: {exc}"
        out["steps"] = ray.get(actor.got.remote())
        return out
    finally:
        ray.shutdown()


@pytest.mark.timeout(180)
def test_base_url_beside_verls_server_actor_is_refused_the_same_server_is_synced_and_told():
    """Before: base_url's server was synced and verl's server actor, which verl's agent loop
    generates from, was neither synced nor told the step, with no word."""
    from fsdp_sync.cli.launch import run_ranks, spawn_env
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer

    with ReferenceEngine("tiny", tp_size=1, seed=5, dtype=torch.float32) as verls, \
            EngineServer(verls) as verl_srv, \
            ReferenceEngine("tiny", tp_size=1, seed=5, dtype=torch.float32) as other, \
            EngineServer(other) as other_srv:
        a0, b0 = verls.weights_checksum(), other.weights_checksum()
        (out,) = run_ranks(_base_url_beside_verls_server, 1, verl_srv.url, other_srv.url,
                           timeout_s=150, env=spawn_env({"VERL_PLATFORM": "cpu"}))
        assert other.weights_checksum() == b0           # nothing went beside verl's server
        assert verls.weights_checksum() != a0           # the one verl generates from: synced
    assert out["beside"].startswith("ValueError: rollout.custom.fsdp_sync.base_url="), out
    assert "sglang_server_0_0" in out["beside"] and verl_srv.url in out["beside"] \
        and other_srv.url in out["beside"], out
    assert out["same"] == "synced" and out["steps"] == [7], out


# --------------------------------------------------------------------------- quantization override

@pytest.mark.parametrize("verls, ours", [("fp8", None), (None, "fp8")])
def test_a_quantization_contradicting_the_one_verl_starts_its_server_with_is_refused(verls, ours):
    """verl3 audit, item 3: verl starts SGLang with ``rollout.quantization``; a different
    ``custom.fsdp_sync.quantization`` was taken, sending bf16 weights into an FP8 server or the
    reverse. Refused, naming both keys and values and what to set; the same value, or a
    ``base_url`` of the user's own (that server runs the override), is taken."""
    from fsdp_sync.integrations.verl import sync_config

    cfg = dict(_rollout(quantization=ours), quantization=verls)
    with pytest.raises(ValueError) as err:
        sync_config(cfg)
    y = {None: "null", "fp8": "fp8"}
    msg = str(err.value)
    assert f"rollout.custom.fsdp_sync.quantization={y[ours]} contradicts" in msg, msg
    assert f"actor_rollout_ref.rollout.quantization={y[verls]}, which verl starts" in msg, msg
    assert f"set actor_rollout_ref.rollout.quantization={y[ours]}" in msg, msg
    assert sync_config(dict(_rollout(quantization=verls), quantization=verls)).quantization == verls
    own = dict(_rollout(quantization=ours, base_url="http://127.0.0.1:9"), quantization=verls)
    assert sync_config(own).quantization == ours


def test_a_quantization_override_into_verls_own_server_is_refused(monkeypatch):
    """With ``base_url`` naming the server verl's actor runs (started with rollout.quantization),
    the override is refused at the first sync, on every rank; a base_url where no actor of verl's
    runs (a server of the user's own) keeps it."""
    import types

    import verl  # noqa: F401
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    from fsdp_sync.integrations.verl import adapter

    class Remote:
        def __init__(self, value):
            self.value = value

        def remote(self, *args):
            async def answer():
                return self.value
            return answer()

    def build(url):
        cfg = dict(_rollout(quantization="fp8", base_url=url), quantization=None,
                   tensor_model_parallel_size=1)
        return get_rollout_class("sglang", "async")(
            config=omega_conf_to_dataclass(OmegaConf.create(cfg), RolloutConfig),
            model_config=types.SimpleNamespace(hf_config=None), device_mesh=None)

    actor = types.SimpleNamespace(get_server_address=Remote(("127.0.0.1", 30123)))
    monkeypatch.setattr(adapter, "named_actor", lambda name: actor)
    rollout = build("http://localhost:30123")
    with pytest.raises(ValueError, match="is verl's own server") as err:
        asyncio.run(rollout._check_base_url())
    assert "actor_rollout_ref.rollout.quantization=null" in str(err.value), err.value
    monkeypatch.setattr(adapter, "named_actor", lambda name: None)
    rollout = build("http://localhost:30123")
    asyncio.run(rollout._check_base_url())
    assert rollout.sync.quantization == "fp8"
