"""`tp_model.TPModel` run in this process at TP 1 (no workers, no process group), against
transformers: the paths the engine's tests do not reach through its workers. A prefill that
continues from tokens already in the KV cache (``n_cached > 0`` with several new tokens: the
causal mask of `TPModel._attend`), a two-token prompt (the smallest one that needs a causal
mask), rows packed side by side in one forward, and the start-up weights of any seed
`ReferenceEngine` takes (`initial_tensors`)."""

from __future__ import annotations

import threading

import pytest
import torch

from fsdp_sync.engines.reference.engine_args import SEED_RANGE
from fsdp_sync.engines.reference.tp_model import ModelSpec, Span, TPLayout, TPModel, initial_tensors, shard_state_dict
from fsdp_sync.models import build_model, load_config

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def pair():
    """The tiny model (GQA: 4 query heads, 2 KV heads) and a TP-1 `TPModel` holding its weights."""
    cfg = load_config("tiny")
    hf = build_model(cfg, seed=0).eval()
    layout = TPLayout(ModelSpec.from_config(cfg), 1)
    m = TPModel(layout, 0, dtype=torch.float32, device="cpu")
    m.params = {k: v.clone() for k, v in shard_state_dict(hf.state_dict(), layout, 0).items()}
    return hf, m


@torch.no_grad()
def hf_logits(hf, prompt):
    return hf(input_ids=torch.tensor([prompt])).logits[0].float()


def kv_cache(m, tokens):
    L = m.layout
    return torch.zeros(m.spec.num_layers, 2, tokens, L.kv_local, m.spec.head_dim)


@torch.no_grad()
def test_a_prefill_that_continues_from_cached_tokens_matches_one_whole_forward(pair):
    """Prompt split 5 + 4: the second chunk attends to the 5 cached keys and causally to its own."""
    hf, m = pair
    prompt = [201, 3, 64, 64, 17, 88, 42, 9, 120]
    ref = hf_logits(hf, prompt)
    kv = kv_cache(m, 32)
    slot = 7     # not at slot 0: the span's own run of the cache
    first = m.forward(torch.tensor(prompt[:5]), torch.arange(5), [Span(0, 5, slot, 0)], kv, torch.arange(5))
    rest = m.forward(torch.tensor(prompt[5:]), torch.arange(5, 9), [Span(0, 4, slot, 5)], kv, torch.arange(4))
    got = torch.cat([first, rest])
    assert (got - ref).abs().max() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@torch.no_grad()
def test_a_two_token_prompt_is_causal(pair):
    hf, m = pair
    prompt = [300, 5]
    got = m.forward(torch.tensor(prompt), torch.arange(2), [Span(0, 2)], None, torch.arange(2))
    assert (got - hf_logits(hf, prompt)).abs().max() < 1e-5


@torch.no_grad()
def test_rows_packed_in_one_forward_match_each_alone(pair):
    """Two sequences packed in one batch (with a KV cache, each in its own slots) get their own
    logits: neither attends to the other's tokens."""
    hf, m = pair
    a, b = [11, 27, 93, 5], [7, 400, 2]
    kv = kv_cache(m, 16)
    ids = torch.tensor(a + b)
    pos = torch.cat([torch.arange(4), torch.arange(3)])
    got = m.forward(ids, pos, [Span(0, 4, 0, 0), Span(4, 3, 8, 0)], kv, torch.arange(7))
    assert (got[:4] - hf_logits(hf, a)).abs().max() < 1e-5
    assert (got[4:] - hf_logits(hf, b)).abs().max() < 1e-5


@pytest.mark.parametrize("seed", [SEED_RANGE[0], -1, 2 ** 63, SEED_RANGE[1]])
def test_every_seed_the_engine_takes_gives_start_up_weights(seed):
    """`check_engine_args` takes seeds in [-2**63, 2**64 - 1]; each worker draws its start-up
    weights from ``seed * 100_003 + i``, which overflowed torch's seed range for |seed| beyond
    about 2**47: `ReferenceEngine('tiny', seed=2**62)` failed in its workers with
    'ValueError: Overflow when unpacking long long'."""
    layout = TPLayout(ModelSpec.from_config(load_config("tiny")), 1)
    draws = dict(initial_tensors(layout, seed))
    assert list(draws) == list(layout.hf_shapes)
    w = draws["model.layers.0.self_attn.q_proj.weight"]
    assert w.std() > 0 and not torch.equal(w, draws["model.layers.0.self_attn.k_proj.weight"][:w.shape[0]])


def test_the_start_up_weights_of_small_seeds_are_unchanged():
    """Seeds whose draws were in torch's range keep their weights (demo and tests rely on them)."""
    layout = TPLayout(ModelSpec.from_config(load_config("tiny")), 1)
    for seed in (0, 7, -3):
        for i, (name, t) in enumerate(initial_tensors(layout, seed)):
            if name.endswith("norm.weight") or name.endswith(".bias"):
                continue
            g = torch.Generator().manual_seed(seed * 100_003 + i)
            assert torch.equal(t, torch.randn(t.shape, generator=g) * layout.spec.initializer_range), name
            break


@pytest.mark.parametrize("tp,vocab", [(2, 512), (4, 500)])
def test_each_vocab_shard_embeds_its_own_ids_up_to_its_edges(tp, vocab):
    """The vocab-parallel embedding: each rank embeds the ids of its shard and zeros elsewhere, so
    the all-reduce of the ranks' rows is the full embedding; ids at each shard's first and last
    row included (500 over 4 ranks: the last shard padded)."""
    cfg = load_config("tiny", vocab_size=vocab)
    layout = TPLayout(ModelSpec.from_config(cfg), tp)
    full = torch.randn(vocab, cfg.hidden_size)
    edges = sorted({i for r in range(tp) for i in (r * layout.vocab_shard - 1, r * layout.vocab_shard)
                    if 0 <= i < vocab} | {0, vocab - 1})
    ids = torch.tensor(edges)
    total = torch.zeros(len(edges), cfg.hidden_size)
    for r in range(tp):
        m = TPModel(layout, r, dtype=torch.float32, device="cpu")
        m.params = {"model.embed_tokens.weight": torch.zeros(layout.vocab_shard, cfg.hidden_size)}
        for pl in layout.placements("model.embed_tokens.weight", r):
            m.params[pl.engine][pl.dst] = full[pl.src]
        m._all_reduce = lambda x: x        # this rank's rows, before the all-reduce
        total += m.embed(ids)
    assert torch.equal(total, full[ids])


# --------------------------------------------------------------------------- TP > 1 in threads

class ThreadGroup:
    """The two collectives `TPModel` uses, between ranks that run in threads of this process
    (each rank's contribution summed / concatenated in rank order)."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=30), [None] * n

    def _exchange(self, rank, x):
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts

    def attach(self, m: TPModel, rank: int) -> None:
        def all_reduce(x):
            parts = self._exchange(rank, x)
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            return x.copy_(total)

        m._all_reduce = all_reduce
        m._all_gather_last = lambda x: torch.cat(self._exchange(rank, x), dim=-1)


@torch.no_grad()
def tp_logits(cfg, hf, tp, prompts):
    """Every position's logits of ``prompts`` packed in one forward of ``tp`` ranks in threads."""
    layout = TPLayout(ModelSpec.from_config(cfg), tp)
    group, out, errors = ThreadGroup(tp), [None] * tp, []
    sd = hf.state_dict()
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    spans, off = [], 0
    for p in prompts:
        spans.append(Span(off, len(p)))
        off += len(p)

    def run(r):
        try:
            m = TPModel(layout, r, dtype=torch.float32, device="cpu")
            m.params = {k: v.clone() for k, v in shard_state_dict(sd, layout, r).items()}
            group.attach(m, r)
            out[r] = m.forward(ids, pos, spans, None, torch.arange(len(ids)))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for r in range(1, tp):
        assert torch.equal(out[r], out[0]), r      # every rank computes the same logits
    return list(out[0].split([len(p) for p in prompts]))


@pytest.mark.parametrize("tp,overrides", [
    (4, {}),                                                # 2 KV heads over 4 ranks: each held by two
    (4, {"tie_word_embeddings": True, "vocab_size": 500}),   # tied head, the last vocab shard padded
    (2, {"model_type": "qwen3", "num_key_value_heads": 1}),  # per-head q/k norms, one KV head replicated
    (2, {"model_type": "llama", "attention_bias": True, "mlp_bias": True}),
], ids=["kv-replicated", "tied-padded", "qwen3", "llama-bias"])
def test_tp_ranks_compute_transformers_logits(tp, overrides):
    cfg = load_config("tiny", **overrides)
    hf = build_model(cfg, seed=6).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias") or n.endswith("norm.weight"):
                p.normal_(0.5 if n.endswith("norm.weight") else 0.0, 0.1)   # not the start-up ones/zeros
    prompts = [[11, 27, 93, 5], [cfg.vocab_size - 1, 3, 250, 251, 256], [7]]
    for got, p in zip(tp_logits(cfg, hf, tp, prompts), prompts):
        assert (got - hf_logits(hf, p)).abs().max() < 1e-5, p
