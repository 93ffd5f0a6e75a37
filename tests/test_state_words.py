"""Tagged payloads inside a sync share pages of state words (`weights.state_words`): a slot is
handed out again only once its state is final, an old payload whose slot went to a later one is
refused as released (never opened with the later payload's state), and nothing is left behind."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.weights import bucket, handles, state_words
from fsdp_sync.weights.handles import HandleError, make_payloads, open_payload
from fsdp_sync.weights.shm import add_torch_reference

from _util import Consumer, digest, num_fds, shm_segments

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def consumer():
    with Consumer() as c:
        yield c


def _bucket(seed: int, buf: torch.Tensor | None = None) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"w{i}": torch.randn(3, 5, generator=g) for i in range(4)}
    (b,) = bucket.plan_buckets([bucket.TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)
    flat = bucket.flatten(b, tensors, out=(buf[:b.nbytes] if buf is not None else handles.empty_shared(b.nbytes)))
    return tensors, {"flattened_tensor": flat, "metadata": bucket.sglang_metadata(b)}


def _slot(ps: handles.PayloadSet) -> tuple[int, int]:
    (slot,) = ps._slots
    return slot.index, slot.gen


def test_a_syncs_payloads_share_one_page_and_take_final_slots_again(consumer):
    handles.empty_shared(1)     # this process's first segment connects it to torch's manager
    shm, fds = shm_segments(), num_fds()
    buf = handles.empty_shared(4096)
    with state_words.pooled():
        seen = []
        for i in range(5):
            tensors, obj = _bucket(i, buf)
            with make_payloads(obj, 1) as ps:
                seen.append(_slot(ps))
                assert ps.states[0].untyped_storage().nbytes() == state_words.SLOTS * 8
                (got,) = consumer.open(ps.payloads, ranks=[0])
                assert got["tensors"] == {n: digest(t) for n, t in tensors.items()}
                assert ps.state(0) == handles.ACKED
            # made during the pool: the buffer and one page, not a segment a payload
            assert len(shm_segments() - shm) == 2
        # acknowledged: the same slot each time, a new generation each time
        assert [s[0] for s in seen] == [seen[0][0]] * 5
        assert [s[1] for s in seen] == [seen[0][1] + k for k in range(5)]
    del buf, obj, ps
    assert shm_segments() <= shm
    assert num_fds() == fds


def test_outside_a_sync_each_payload_has_its_own_word():
    _, obj = _bucket(0)
    with make_payloads(obj, 2) as ps:
        assert ps._slots == []
        assert [s.untyped_storage().nbytes() for s in ps.states] == [4, 4]
        for r in (0, 1):
            open_payload(ps.payloads[r], r).ack()


def test_a_released_payload_whose_slot_was_taken_again_is_refused(consumer):
    """The old payload's bytes still name a live buffer and the reused slot: without the
    generation it would open as the new payload, with the old metadata over the new data."""
    buf = handles.empty_shared(4096)
    with state_words.pooled():
        _, obj_a = _bucket(1, buf)
        ps_a = make_payloads(obj_a, 1)
        old = ps_a.payloads[0]
        consumer.open(ps_a.payloads, ranks=[0])
        slot_a = _slot(ps_a)
        ps_a.release()
        tensors_b, obj_b = _bucket(2, buf)
        with make_payloads(obj_b, 1) as ps_b:
            assert _slot(ps_b)[0] == slot_a[0] and _slot(ps_b)[1] == slot_a[1] + 1
            (stale,) = consumer.open([old], ranks=[0])
            assert "released by its producer before it was opened" in stale["error"]
            assert ps_b.state(0) == handles.FRESH          # the stale open changed nothing
            (got,) = consumer.open(ps_b.payloads, ranks=[0])
            assert got["tensors"] == {n: digest(t) for n, t in tensors_b.items()}
        # in the producer's own process too
        _, obj_c = _bucket(3, buf)
        with make_payloads(obj_c, 1) as ps_c:
            with pytest.raises(HandleError, match="released by its producer before it was opened"):
                open_payload(old, 0)
            open_payload(ps_c.payloads[0], 0).ack()


def test_a_slot_opened_but_not_acknowledged_is_never_handed_out_again(consumer):
    buf = handles.empty_shared(4096)
    with state_words.pooled():
        _, obj = _bucket(4, buf)
        ps = make_payloads(obj, 1)
        late = open_payload(ps.payloads[0], 0)          # opened, its acknowledgement still to come
        retired = _slot(ps)
        with pytest.raises(HandleError, match=r"\[0\] never acknowledged"):
            ps.release()
        tensors, obj2 = _bucket(5, buf)
        with make_payloads(obj2, 1) as ps2:
            assert _slot(ps2)[0] != retired[0]
            late.ack()                                  # the late consumer writes its own word only
            assert ps2.state(0) == handles.FRESH
            (got,) = consumer.open(ps2.payloads, ranks=[0])
            assert got["tensors"] == {n: digest(t) for n, t in tensors.items()}


def test_a_revoked_slot_is_taken_again_and_its_payload_stays_refused(consumer):
    buf = handles.empty_shared(4096)
    with state_words.pooled():
        _, obj = _bucket(6, buf)
        ps = make_payloads(obj, 1)
        unopened, revoked = ps.payloads[0], _slot(ps)
        with pytest.raises(HandleError, match="never acknowledged"):
            ps.release()                                # nobody opened it: revoked, slot final
        with make_payloads(obj, 1) as ps2:
            assert _slot(ps2) == (revoked[0], revoked[1] + 1)
            (got,) = consumer.open([unopened], ranks=[0])
            assert "released by its producer before it was opened" in got["error"]
            consumer.open(ps2.payloads, ranks=[0])


def test_many_payloads_at_once_take_more_pages_and_leave_nothing():
    handles.empty_shared(1)
    shm = shm_segments()
    _, obj = _bucket(7)
    with state_words.pooled():
        sets = [make_payloads(obj, 1) for _ in range(state_words.SLOTS + 3)]
        pages = {s._slots[0].page for s in sets}
        assert len(pages) == 2
        for s in sets:
            open_payload(s.payloads[0], 0).ack()
            s.release()
    del sets, pages, obj, s
    assert shm_segments() <= shm


@pytest.mark.parametrize("gen, words", [("1", "malformed"), (1.0, "malformed"), (True, "malformed"),
                                        (5, "no generation beside it")])
def test_a_crafted_generation_is_refused(gen, words):
    """A ``gen`` that is not an int, or a state word with no room for one, is refused. (A refusal
    after the tag was read hands the consumer's references back for the rightful consumer, which
    the producer's release then gives back; a malformed tag is refused before that.)"""
    _, obj = _bucket(8)
    state = handles.empty_shared(4).view(torch.int32)
    state.zero_()
    tagged = dict(obj, **{handles.TAG: {"rank": 0, "of": 1, "state": state, "gen": gen}})
    shared: list = []
    data = handles._dump(tagged, [], shared, [], {})
    try:
        with pytest.raises(HandleError, match=words):
            open_payload(data, 0)
        assert int(state[0]) == handles.FRESH
    finally:    # what the producer's release does for a payload nobody opened
        for storage in shared if words != "malformed" else ():
            add_torch_reference(storage, -1)
