"""Contracts H50's mutation pass found untested (gather, state_words, experts), in process.

- `gather.alloc_bucket` refuses a buffer shorter than the bucket, naming the size it needed and
  the size it got: with the length check dropped, tests/test_h23_alloc_agree.py (a float32
  buffer, a MemoryError) still passed, and a short buffer on one rank would fail that rank alone
  inside the bucket's gather (its peers waiting out the group's timeout).
"""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync.weights import bucket, gather


def test_a_bucket_buffer_shorter_than_the_bucket_is_refused_naming_both_sizes():
    (bkt,) = bucket.plan_buckets([("a", torch.bfloat16, (3,)), ("b", torch.float32, (5,))], 1 << 20)
    assert bkt.nbytes == 48
    with pytest.raises(ValueError, match=r"alloc\(48\) must return a 1-D uint8 tensor of at least 48 "
                                         r"bytes, got torch.uint8 \(47,\)"):
        gather.alloc_bucket(lambda n: torch.empty(n - 1, dtype=torch.uint8), bkt, 0, None)
    flat = gather.alloc_bucket(lambda n: torch.empty(n + 16, dtype=torch.uint8), bkt, 0, None)
    assert flat.numel() == 64          # a longer one is the caller's to give


def test_a_slot_given_back_on_an_earlier_page_is_taken_before_the_last_page_grows():
    """`state_words.take` hands out the first page's free slot, not only the newest page's: with
    that mutant, a sync of more payloads than one page holds made a new page whenever its newest
    one filled, though slots acknowledged on the first were free (test_state_words.py passed)."""
    from fsdp_sync.weights import handles, state_words

    with state_words.pooled():
        slots = [state_words.take(handles.empty_shared) for _ in range(state_words.SLOTS + 1)]
        first, last = slots[0], slots[-1]
        assert first.page is not last.page and len({id(s.page) for s in slots}) == 2
        first.state[0] = handles.ACKED            # final: nobody writes it again
        state_words.give_back(first)
        again = state_words.take(handles.empty_shared)
        assert (again.page, again.index, again.gen) == (first.page, first.index, first.gen + 1)
        assert int(again.state[0]) == 0 and int(state_words.words_of(again.state)[1]) == again.gen
    del slots, first, last, again


def test_mixtrals_renamed_router_gets_the_fused_names_hint_and_no_other_familys_does():
    """`experts.fused_hint` names transformers 5's ``mlp.gate.weight`` for Mixtral (its
    ``block_sparse_moe.gate.weight`` renamed), and only there: a Qwen MoE's ``mlp.gate.weight`` is
    its own checkpoint name (dropping the Mixtral clause survived the MoE tests)."""
    from fsdp_sync.weights.experts import fused_hint

    assert "send the checkpoint's per-expert names" in fused_hint("model.layers.1.mlp.gate.weight", "mixtral")
    assert fused_hint("model.layers.1.mlp.gate.weight", "qwen2_moe") == ""
    assert fused_hint("model.layers.1.mlp.experts.down_proj", "qwen3_moe") != ""
    assert fused_hint("model.layers.1.mlp.experts.down_proj", "llama") == ""


# --------------------------------------------------------------------------- one bucket, 3 ranks

class _Group:
    """Three threads as the ranks of one gather group: `gather.all_gather`, `gather.broadcast` and
    the point-to-point sends answered as gloo would (each rank's bytes, in rank order)."""

    def __init__(self, world: int) -> None:
        import threading

        self.world, self.me = world, threading.local()
        self.barrier = threading.Barrier(world, timeout=20)
        self.slots: list = [None] * world
        self.sent: dict = {}
        self.lock = threading.Lock()

    def _exchange(self, x):
        self.slots[self.me.rank] = x
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def all_gather(self, out, inp, group):
        outs, ins = (out, inp) if isinstance(out, list) else ([out], [inp])
        got = self._exchange([i.clone() for i in ins])
        for k, o in enumerate(outs):
            o.copy_(torch.cat([g[k].reshape(-1) for g in got]).view(o.shape))

    def broadcast(self, t, group, src):
        t.copy_(self._exchange(t.clone())[src])

    def isend(self, t, group=None, group_dst=None, tag=0):
        with self.lock:
            self.sent[(self.me.rank, group_dst, tag)] = t.clone()
        return types.SimpleNamespace(wait=lambda: None)

    def irecv(self, t, group=None, group_src=None, tag=0):
        import time

        def wait():
            key = (group_src, self.me.rank, tag)
            for _ in range(4000):
                with self.lock:
                    if key in self.sent:
                        t.view(-1).view(torch.uint8).copy_(self.sent.pop(key).view(-1).view(torch.uint8))
                        return
                time.sleep(0.005)
            raise TimeoutError(key)
        return types.SimpleNamespace(wait=wait)

    def run(self, fn):
        import threading

        out: list = [None] * self.world

        def rank(r):
            self.me.rank = r
            try:
                out[r] = fn(r)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                out[r] = exc
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out


def test_one_bucket_of_owned_experts_uneven_and_even_pieces_is_bit_exact_on_every_rank(monkeypatch):
    """`gather.fill_bucket` over 3 ranks, the bucket's pieces as `export` makes them: a fused
    tensor of 4 experts (rows 2, 2, 0 on 3 ranks) cut expert by expert (`sub_pieces`: experts 0
    and 1 held whole by rank 0, 2 and 3 by rank 1: a run of one owner, then another owner's right
    after it), an uneven tensor (7 rows: 3, 3, 1), an even one, an empty one and a replicated
    one, cast (bfloat16, float16, float8_e4m3fn) and not; without the uneven one too (the
    coalesced all-gather, not the packed one); all-gathered, and gathered to rank 1 only
    (``dst``). Every rank's bucket equals `bucket.flatten` of the whole tensors, byte for byte
    (to ``dst``: rank 1's). The real collectives run in tests/test_export.py and test_moe.py;
    these threads run in 0.3 s."""
    import types as _t

    from fsdp_sync.weights.shards import chunk_counts

    g = torch.Generator().manual_seed(50)
    fused = torch.randn(4, 2, 4, generator=g)
    whole = {f"e{e}": fused[e] for e in range(4)}
    whole.update({"odd": torch.randn(7, 3, generator=g), "even": torch.randn(6, 2, generator=g),
                  "empty": torch.randn(0, 5, generator=g), "norm": torch.randn(5, generator=g)})
    grp = _Group(3)
    monkeypatch.setattr(gather, "all_gather", grp.all_gather)
    monkeypatch.setattr(gather, "broadcast", grp.broadcast)
    monkeypatch.setattr(gather, "dist", _t.SimpleNamespace(isend=grp.isend, irecv=grp.irecv))
    monkeypatch.setattr(gather, "data_group", lambda group, t: group)   # the threads' group moves CPU tensors

    def pieces(t: torch.Tensor, rank: int) -> gather.Pieces:
        counts = chunk_counts(t.shape[0], t[0].numel() if t.shape[0] else 0, 3)
        start = sum(counts[:rank])
        return gather.Pieces(t.reshape(-1)[start:start + counts[rank]], counts, "g", rank)

    for sharded in (("odd", "even", "empty"), ("even", "empty")):
        names = [f"e{e}" for e in range(4)] + list(sharded) + ["norm"]
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
            (bkt,) = bucket.plan_buckets([(n, dtype, tuple(whole[n].shape)) for n in names], 1 << 20)
            want = bucket.flatten(bkt, {n: whole[n].to(dtype) for n in names})
            for dst in (None, 1):
                def job(rank):
                    fp = pieces(fused, rank)
                    items = [_t.SimpleNamespace(pieces=gather.sub_pieces(fp, e * 8, 8), full=None,
                                                dtensor=None) for e in range(4)]
                    items += [_t.SimpleNamespace(pieces=pieces(whole[n], rank), full=None, dtensor=None)
                              for n in sharded]
                    items.append(_t.SimpleNamespace(pieces=None, full=whole["norm"], dtensor=None))
                    flat = torch.full((bkt.nbytes,), 0xAB, dtype=torch.uint8)
                    gather.fill_bucket(bkt, items, flat, gather.Scratch(), dst)
                    return flat

                for rank, flat in enumerate(grp.run(job)):
                    assert isinstance(flat, torch.Tensor), (sharded, dtype, dst, rank, flat)
                    if dst is None or rank == dst:
                        ref = dict(bucket.unflatten(want, bkt.entries))
                        bad = [n for n, v in bucket.unflatten(flat, bkt.entries)
                               if not torch.equal(v.view(torch.uint8), ref[n].view(torch.uint8))]
                        assert torch.equal(flat, want), (sharded, dtype, dst, rank, bad)


def test_a_sharded_tensors_local_shard_that_contradicts_its_metadata_is_refused(monkeypatch):
    """`shards.sharded_tensor_pieces` refuses a local shard whose size is not what the shard
    metadata gives this rank, and metadata whose shards do not cover the rows: gathered, the
    peers would take other sizes (a mismatched all-gather) or rows would be missing (dropping
    the local-size check survived tests/test_export.py and test_h22_sharded_tensor_order.py)."""
    from fsdp_sync.weights import shards

    monkeypatch.setattr(shards.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(shards.dist, "get_rank", lambda group=None: 1)

    def st(sizes, local_rows):
        offs = [sum(sizes[:i]) for i in range(len(sizes))]
        metas = [types.SimpleNamespace(shard_offsets=[o, 0], shard_sizes=[s, 3],
                                       placement=types.SimpleNamespace(rank=lambda r=r: r))
                 for r, (o, s) in enumerate(zip(offs, sizes))]
        md = types.SimpleNamespace(size=torch.Size([4, 3]), shards_metadata=metas,
                                   tensor_properties=types.SimpleNamespace(dtype=torch.float32))
        local = torch.ones(local_rows, 3)
        return types.SimpleNamespace(metadata=lambda: md, _process_group=None,
                                     local_shards=lambda: [types.SimpleNamespace(tensor=local)])

    assert shards.sharded_tensor_pieces("w", st([2, 2], 2)).counts == (6, 6)
    with pytest.raises(ValueError, match=r"'w' \(rank 0\): local shard has 9 elements, the shard "
                                         r"metadata says 6"):
        shards.sharded_tensor_pieces("w", st([2, 2], 3))
    with pytest.raises(ValueError, match=r"'w' \(rank 0\): shards cover 3 of 4 rows"):
        shards.sharded_tensor_pieces("w", st([2, 1], 1))


def test_a_tight_bucket_holds_a_tensor_that_ends_exactly_at_the_budget():
    """`bucket.plan_tight` (SGLang's broadcast layout) fills a bucket up to its budget exactly,
    and opens the next one a byte over it (``>=`` for ``>`` survived test_bucket.py: a bucket
    closed one tensor early, one broadcast more)."""
    f32, bf16 = torch.float32, torch.bfloat16
    plan = bucket.plan_tight([("a", f32, (4,)), ("b", f32, (4,)), ("c", bf16, (1,))], 32)
    assert [b.names for b in plan] == [["a", "b"], ["c"]] and [b.nbytes for b in plan] == [32, 2]
    plan = bucket.plan_tight([("a", f32, (4,)), ("b", bf16, (8,)), ("c", bf16, (1,))], 33)
    assert [b.names for b in plan] == [["a", "b"], ["c"]]
    plan = bucket.plan_buckets([("a", f32, (4,)), ("b", f32, (4,)), ("c", bf16, (1,))], 32)
    assert [b.names for b in plan] == [["a", "b"], ["c"]] and plan[0].nbytes == 32
