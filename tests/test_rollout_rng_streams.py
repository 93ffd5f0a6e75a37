"""`manager_rng.RolloutRng`: the generation stream continues from block to block, also when a
block's restore did not run, and the trainer's stream comes back as it was.

The generation stream is ``torch.manual_seed(seed)``'s: block after block, what a rollout draws
is the continuation of one generator of that seed. A block whose restore did not run (its
``restore_rng`` stage failed) leaves the generation stream live; the next block's swap must take
it from there, not start again from the state the last restore kept (which would hand the next
rollout the same random numbers as the last one).
"""

from __future__ import annotations

import torch

from fsdp_sync.manager_rng import RolloutRng


def _draws(seed: int, n: int, k: int = 3) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(k, generator=g).tolist() for _ in range(n)]


def test_blocks_continue_one_generation_stream_and_give_the_trainer_its_own_back():
    torch.manual_seed(1234)
    trainer = torch.get_rng_state()
    rng = RolloutRng(7)
    assert torch.equal(torch.get_rng_state(), trainer)      # making it touches nothing
    got = []
    for _ in range(3):
        rng.swap()
        got.append(torch.rand(3).tolist())
        rng.restore()
        assert torch.equal(torch.get_rng_state(), trainer)
    assert got == _draws(7, 3)


def test_a_block_whose_restore_did_not_run_is_continued_not_replayed():
    torch.manual_seed(99)
    trainer = torch.get_rng_state()
    rng = RolloutRng(5)
    rng.swap()
    first = torch.rand(3).tolist()
    rng.restore()
    rng.swap()
    second = torch.rand(3).tolist()
    # the restore of this block did not run: the generation stream is still live
    rng.swap()
    third = torch.rand(3).tolist()
    rng.restore()
    assert [first, second, third] == _draws(5, 3)
    assert third != second
    assert torch.equal(torch.get_rng_state(), trainer)       # the trainer's, kept from before
    rng.swap()
    assert torch.rand(3).tolist() == _draws(5, 4)[3]
    rng.restore()
