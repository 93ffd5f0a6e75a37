"""What ``SyncConfig.verify`` leaves out on purpose: the vocab padding rows (H6 audit).

The engine's ``embed_tokens`` / ``lm_head`` are padded up to a multiple of 64 (x TP) rows; no HF
tensor fills those rows, and the reference engine's per-rank digests (`layout.rank_digest`) hash
only the pieces the layout places, so a sync that wrote garbage into the padding passes verify.
That is correct because no result reads the padding: the reference engine refuses a prompt token
outside ``[0, vocab_size)`` and cuts the logits to ``vocab_size`` columns after the TP all-gather
(``tp_model``), as SGLang 0.5.23 does (``VocabParallelEmbedding`` masks ids past the real vocab to
zero; ``LogitsProcessor`` keeps ``logits[:, :vocab_size]``; its ``/weights_checker`` hashes whole
parameters, padding included, which the SGLang verify path recomputes with zero padding).

This test holds the engine to that: a per-rank sync whose padding rows are NaN (the trainer's
`reshard._zero_gaps` replaced) lands them in the engine (its whole-shard checksum changes) and
still serves the same logits and greedy tokens, bit for bit, as the same weights with zero
padding; verify passes on both. If the engine ever read a padding row (logits uncut, an id past
the vocab looked up), the NaNs would reach the logits and this test fails: verify would then have
to check the padding.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks

TP = 2
VOCAB = 500            # padded to 512: TP rank 1 holds rows 244..255 of its shard as padding
PROMPTS = [[1, 2, 3, 499], [498, 7, 250]]


def _job(rank, world, root):
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.weights import reshard

    torch.set_num_threads(1)
    cfg = load_config("tiny", vocab_size=VOCAB)
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    mesh = make_mesh(world // TP, TP)
    holder = SyncTopology.from_mesh(mesh).is_tp_src
    engine = ReferenceEngine(model_config=cfg, tp_size=TP, kv_cache_tokens=64) if holder else None
    zero = reshard._zero_gaps

    def garbage(flat, bkt, layout, r):
        zero(flat, bkt, layout, r)
        for e in bkt.entries:
            pad = layout.padding(e.name, r)
            if pad is not None:
                reshard._param2d(flat, e)[pad[0]] = float("nan")

    out = []
    try:
        for bad in (False, True):
            reshard._zero_gaps = garbage if bad else zero
            manager = FSDPShardingManager(module, engine, mesh=mesh,
                                          config=SyncConfig(dtype=torch.float32, method="tensor", layout="engine",
                                                            free_cache_engine=False, dist_timeout_s=60, verify="full"))
            rec = {}
            try:
                with manager:
                    pass
            except SyncError as exc:
                rec["error"] = str(exc)
            finally:
                manager.close()
                reshard._zero_gaps = zero
            if engine is not None:
                rec["shards"] = engine.shard_checksums()
                rec["logits"] = engine.forward_logits(PROMPTS, all_positions=True)
                rec["tokens"] = engine.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
            out.append(rec)
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(240)
def test_nan_in_the_vocab_padding_changes_no_logit_and_verify_passes(tmp_path):
    results = run_ranks(_job, 2, str(tmp_path), timeout_s=220)
    for r in results:
        assert [rec.get("error") for rec in r] == [None, None], r
    clean, bad = next(r for r in results if "shards" in r[0])
    # the NaNs landed: only TP rank 1 holds padding rows, and its whole-shard checksum changed
    assert clean["shards"][0] == bad["shards"][0] and clean["shards"][1] != bad["shards"][1], (clean["shards"], bad["shards"])
    for a, b in zip(clean["logits"], bad["logits"]):
        assert a.shape[-1] == VOCAB and torch.isfinite(b).all()
        assert torch.equal(a, b)
    assert clean["tokens"] == bad["tokens"]
