"""Verify sees a replica that is wrong on one TP rank only: a replicated piece is held by several
ranks, each computing with its own copy, so every rank's copy is compared, not the one a full
tensor rebuilt from the ranks happens to show.

- LoRA (`lora_sync.verify_adapter`): lora_A of a column-parallel module (q_proj) and lora_B of a
  row-parallel one (o_proj) are on every rank; a wrong copy on TP rank 0 is named (before: rank
  1's copy overwrote rank 0's in `lora_tensors` and verify passed).
- Full-tensor digests (`ReferenceEngine.tensor_checksums`, what ``fsdp-sync serve`` answers and
  `verify.check_sent` reads): a norm wrong on TP rank 1 only gives a checksum that cannot match
  (before: the digest was of the owner's pieces only), and so does a KV head replicated over TP
  ranks (``num_key_value_heads=1``, TP 2) wrong on its owner.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.reference.update_items import pack_plain
from fsdp_sync.engines.sglang import SGLangEngine
from fsdp_sync.lora_sync import verify_adapter
from fsdp_sync.models import build_model, load_config
from fsdp_sync.verify import check_sent, tensor_digest
from fsdp_sync.weights.layout import shard_state_dict

pytestmark = pytest.mark.timeout(120)

NORM = "model.layers.1.input_layernorm.weight"


def _adapter(model, r=4, targets=("q_proj", "o_proj")):
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if name.endswith(".weight") and len(parts) > 3 and parts[-2] in targets and p.dim() == 2:
            base = f"base_model.model.{name[:-len('.weight')]}"
            out[f"{base}.lora_A.weight"] = torch.randn(r, p.shape[1], generator=g) * 0.1
            out[f"{base}.lora_B.weight"] = torch.randn(p.shape[0], r, generator=g) * 0.1
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": list(targets),
           "bias": "none", "use_dora": False, "use_rslora": False}
    return out, cfg


def _stage_per_rank(engine, name, per_rank_named, cfg):
    """A load whose TP ranks each get their own tensors (a replica gone wrong on one rank)."""
    sets, items = [], [[] for _ in range(engine.tp_size)]
    with engine._sched.exclusive(), engine._lock:
        pack_plain(per_rank_named, "hf", items, sets, engine.tp_size)
        per_rank = [{"name": name, "config": dict(cfg), "items": items[r]} for r in range(engine.tp_size)]
        replies = engine._round("lora_stage", per_rank=per_rank, what="test")
        assert all(rep[0] == "ok" for rep in replies.values()), replies
        for s in sets:
            s.release(require_ack=False)
        engine._raise_errors(engine._round("lora_commit", {"name": name}, what="c"), "c", collective=True)


def test_lora_replica_wrong_on_rank0_is_named():
    cfg = load_config("tiny")
    model = build_model(cfg, seed=0)
    tensors, lcfg = _adapter(model)
    with ReferenceEngine(model_config=cfg, tp_size=2, seed=0) as eng:
        eng.load_lora_adapter_from_tensors("L", list(tensors.items()), lcfg)
        assert verify_adapter(eng, "L", tensors) is None
        for target in ("q_proj.lora_A", "o_proj.lora_B"):       # replicated on every rank
            bad = {n: (t.clone().index_put_((torch.tensor([0]), torch.tensor([0])),
                                            torch.tensor(0.25), accumulate=True) if target in n else t)
                   for n, t in tensors.items()}
            _stage_per_rank(eng, "L", [list(bad.items()), list(tensors.items())], lcfg)
            err = verify_adapter(eng, "L", tensors)
            assert err is not None and target in err and "TP rank 0" in err, err
            with pytest.raises(Exception, match="TP rank 1's copy of replicated"):
                eng.lora_tensors("L")          # serve's lora_checksums route reads this
        _stage_per_rank(eng, "L", [list(tensors.items())] * 2, lcfg)
        assert verify_adapter(eng, "L", tensors) is None


def test_tensor_checksums_see_a_replica_wrong_on_one_rank():
    cfg = load_config("tiny")
    module = build_model(cfg, seed=0)
    full = {n: p.detach().clone() for n, p in module.named_parameters()}
    with ReferenceEngine(model_config=cfg, tp_size=2, seed=3, dtype=torch.float32) as eng:
        eng.update_weights_from_tensor(list(full.items()))
        sent = {n: tensor_digest(n, t) for n, t in full.items()}
        assert check_sent(eng, sent, "full", 0)[0] is None
        vals = []
        for r in range(2):
            t = shard_state_dict(full, eng.layout, r)[NORM].clone()
            if r == 1:
                t.view(-1).view(torch.int32)[3] ^= 1 << 20
            vals.append(t)
        eng.update_weights_from_tensor([(NORM, vals)], load_format="direct")
        err = check_sent(eng, sent, "full", 0)[0]
        assert err is not None and NORM in err and "TP rank 1" in err, err
        got = eng.tensor_checksums([NORM])[NORM]
        assert got != sent[NORM]
        with EngineServer(eng) as server:       # fsdp-sync serve's checksum route, as verl reads it
            err = check_sent(SGLangEngine(base_url=server.url), sent, "full", 0)[0]
        assert err is not None and NORM in err and "TP rank 1" in err, err


def test_tensor_checksums_see_a_replicated_kv_head_wrong_on_its_owner():
    """One KV head over TP 2 (``num_key_value_heads=1``): both ranks hold the k rows, rank 0 the
    owner's copy. A k row wrong on rank 0 only gives a checksum that cannot match, named as a
    replica mismatch of k_proj. The layout must mark rank 1 a non-owner of the k rows: were
    every rank an owner, no copy would be compared with another and the full tensor rebuilt
    from rank 1's good copy would hash as the trainer's (the CPU suite only had a norm)."""
    cfg = load_config("tiny", num_key_value_heads=1)
    module = build_model(cfg, seed=0)
    full = {n: p.detach().clone() for n, p in module.named_parameters()}
    qkv, k = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    with ReferenceEngine(model_config=cfg, tp_size=2, seed=3, dtype=torch.float32) as eng:
        assert eng.layout.kv_replicas == 2
        eng.update_weights_from_tensor(list(full.items()))
        sent = {n: tensor_digest(n, t) for n, t in full.items()}
        assert check_sent(eng, sent, "full", 0)[0] is None
        ql = eng.layout.q_local * eng.layout.spec.head_dim
        vals = [shard_state_dict(full, eng.layout, r)[qkv].clone() for r in range(2)]
        vals[0][ql, 0] += 1.0               # the first row of rank 0's k part: the shared KV head
        eng.update_weights_from_tensor([(qkv, vals)], load_format="direct")
        err = check_sent(eng, sent, "full", 0)[0]
        assert err is not None and repr(k) in err and "replica mismatch" in err, err
        assert "1 of" in err, err                               # q and v still match
        assert eng.tensor_checksums([k])[k] != sent[k]


def test_sample_rotates_with_global_steps(tmp_path):
    """verify="sample" picks by ``global_steps`` when set: a manager rebuilt every sync (step 0
    each time) still reaches the tensors outside sync 0's eighth (before: it never did)."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.topology import SyncError
    from fsdp_sync.verify import SAMPLE_EVERY, select

    cfg = load_config("tiny")
    module = build_model(cfg, seed=0)
    names = [n for n, _ in module.named_parameters()]
    wrong = next(n for n in select(names, "sample", 3) if n not in select(names, "sample", 0))
    assert 3 % min(SAMPLE_EVERY, len(names)) != 0
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as eng:
        m = FSDPShardingManager(module, eng, config=SyncConfig(
            method="disk", disk_dir=str(tmp_path), verify="sample", dtype=torch.float32))
        real = m.transport.sync

        def corrupt(ctx):
            real(ctx)
            bad = dict(module.named_parameters())[wrong].detach().clone()
            bad.view(-1)[0] += 1.0
            eng.update_weights_from_tensor([(wrong, bad)])

        m.transport.sync = corrupt
        m.global_steps = 3          # the run's step 3, this manager's first sync
        try:
            with pytest.raises(SyncError, match=wrong.replace(".", r"\.")):
                with m:
                    pass
        finally:
            m.close()


def test_message_reads_the_failing_ranks_own_pieces():
    """Only rank 1's replica is wrong: the message names the first differing element of rank 1's
    own piece (before: the owners' copy was read back and said "its bytes equal the trainer's")."""
    from fsdp_sync import SyncConfig
    from fsdp_sync.verify import verify_engines

    cfg = load_config("tiny")
    module = build_model(cfg, seed=0)
    full = {n: p.detach().clone() for n, p in module.named_parameters()}
    with ReferenceEngine(model_config=cfg, tp_size=2, seed=3, dtype=torch.float32) as eng:
        eng.update_weights_from_tensor(list(full.items()))
        vals = [shard_state_dict(full, eng.layout, r)[NORM].clone() for r in range(2)]
        vals[1].view(-1).view(torch.int32)[3] ^= 1 << 20
        eng.update_weights_from_tensor([(NORM, vals)], load_format="direct")
        err, _ = verify_engines(module, SyncConfig(verify="full", dtype=torch.float32), [eng], 0)
    assert err is not None and "TP rank 1's piece" in err and "flat index 3" in err, err


class _CorruptAfterLoad:
    """An engine that, after every checkpoint it loads (the disk method's commit), has one tensor
    altered (one element + 1)."""

    def __init__(self, engine, name):
        self.engine, self.name = engine, name

    def __getattr__(self, attr):
        return getattr(self.engine, attr)

    def update_weights_from_disk(self, *args, **kw):
        out = self.engine.update_weights_from_disk(*args, **kw)
        bad = self.engine.get_weights_by_name(self.name).clone()
        bad.view(-1)[0] += 1.0
        self.engine.update_weights_from_tensor([(self.name, bad)], flush_cache=False)
        return out


def test_sample_reaches_every_tensor_when_global_steps_skips(tmp_path):
    """One manager, ``global_steps`` up by two per sync (0, 2, …, 14): a tensor at an odd export
    index, wrong after every load, is named within eight syncs (before: the turn was
    ``global_steps``, so only the even eighths were ever checked and all 8 syncs passed)."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.topology import SyncError
    from fsdp_sync.verify import SAMPLE_EVERY

    cfg = load_config("tiny")
    module = build_model(cfg, seed=0)
    names = [n for n, _ in module.named_parameters()]
    assert len(names) >= SAMPLE_EVERY
    wrong = names[3]
    with ReferenceEngine(model_config=cfg, tp_size=1, kv_cache_tokens=64, dtype=torch.float32) as eng:
        m = FSDPShardingManager(module, _CorruptAfterLoad(eng, wrong), config=SyncConfig(
            method="disk", disk_dir=str(tmp_path), verify="sample", dtype=torch.float32))
        caught = []
        try:
            for k in range(SAMPLE_EVERY):
                m.global_steps = 2 * k
                try:
                    with m:
                        pass
                except SyncError as exc:
                    caught.append((k, str(exc)))
                    break
        finally:
            m.close()
    assert caught and wrong in caught[0][1], caught
    assert caught[0][0] == 3, caught        # the turns run 0, 1, 2, 3 from global_steps 0
