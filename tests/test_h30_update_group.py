"""`update_group.open_group`: a rendezvous that completes after the opening gave it up leaves no
group behind (audit H30).

`_make_group` gives the rendezvous up as soon as an engine's ``init_weights_update_group`` fails,
and leaves it running on a daemon thread. Where that engine's workers had joined all the same (its
call failed after they did, e.g. its HTTP client timed out), the rendezvous then completed: the
group, registered under ``dist_group_name`` in torch, was held by nobody and never destroyed, so
every later opening of that name was refused ("exists in this process already (another manager's,
not closed)") until the process exited. In process, with rank 0's rendezvous replaced by one that
completes only once the opening has failed; nothing here depends on timing. The same where the
rendezvous completed first and the engine's failed answer came after (the group made, then
destroyed by `open_group`'s error path: a mutant skipping that survived every test); that error
now names the engine, as the other refusals do.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch


class _JoinedThenFailed:
    tp_size = 1

    def __init__(self, after: threading.Event | None = None) -> None:
        self.left: list[str] = []
        self.after = after

    def init_weights_update_group(self, **kw):
        if self.after is not None:       # answers once trainer rank 0 has made the group
            assert self.after.wait(30)
        raise RuntimeError("the call timed out (injected; its workers joined)")

    def destroy_weights_update_group(self, group_name):
        self.left.append(group_name)
        return True, "ok"


class _Group:
    def __init__(self) -> None:
        self.destroyed = threading.Event()

    def abort(self) -> None:
        pass


@pytest.mark.timeout(60)
def test_a_group_completed_after_the_opening_gave_it_up_is_destroyed(monkeypatch):
    from fsdp_sync.transport import update_group as ug

    gave_up, group = threading.Event(), _Group()

    def late_rendezvous(**kw):        # every member joined, but only after the opening failed
        assert kw["group_name"] == "h30_late_group"
        gave_up.wait(30)
        return group

    def destroy(pg):
        assert pg is group
        pg.destroyed.set()

    monkeypatch.setattr(ug, "new_update_group", late_rendezvous)
    monkeypatch.setattr(ug, "destroy_update_group", destroy)
    cfg = SimpleNamespace(dist_group_name="h30_late_group", dist_timeout_s=20.0, dist_backend="gloo",
                          dist_master_address="127.0.0.1", dist_master_port=None)
    engine = _JoinedThenFailed()
    with pytest.raises(RuntimeError) as info:
        ug.open_group([engine], cfg, torch.device("cpu"), "gloo", ug.EngineCalls())
    assert ("engine 0 init_weights_update_group: the call timed out (injected; its workers "
            "joined) (the group was not waited for)") in str(info.value)
    assert not group.destroyed.is_set()
    gave_up.set()
    # the rendezvous's thread ends at once now; before the fix nothing ever destroyed the group
    assert group.destroyed.wait(30), "the group made after the opening gave it up was left open"


@pytest.mark.timeout(60)
def test_a_group_made_before_an_engines_failed_answer_is_destroyed(monkeypatch):
    from fsdp_sync.transport import update_group as ug

    made, group = threading.Event(), _Group()

    def rendezvous(**kw):
        made.set()
        return group

    monkeypatch.setattr(ug, "new_update_group", rendezvous)
    monkeypatch.setattr(ug, "destroy_update_group", lambda pg: pg.destroyed.set())
    cfg = SimpleNamespace(dist_group_name="h30_made_group", dist_timeout_s=20.0, dist_backend="gloo",
                          dist_master_address="127.0.0.1", dist_master_port=None)
    with pytest.raises(RuntimeError) as info:
        ug.open_group([_JoinedThenFailed(after=made)], cfg, torch.device("cpu"), "gloo", ug.EngineCalls())
    # the engine named, its error once (before: "failed: <error>; an engine said: <error>")
    assert str(info.value).endswith("failed: engine 0 init_weights_update_group: the call timed out "
                                    "(injected; its workers joined)"), str(info.value)
    assert group.destroyed.is_set()
