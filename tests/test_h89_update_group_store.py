"""The weight-update group's store (`transport.update_group.open_group`): trainer rank 0 that
cannot host it because the store timed out is told to raise ``dist_timeout_s`` (naming it and its
value), not only asked whether another program holds the port; a port held by another program is
still named as such. In process: the store's failure is injected, no engine is asked anything."""

import pytest
import torch
import torch.distributed as dist


@pytest.mark.timeout(30)
@pytest.mark.parametrize("failure, says, not_says", [
    (dist.DistStoreError("Timed out after 3 seconds waiting for clients. 1/2 clients joined."),
     "dist_timeout_s=3.0s", "another program"),
    (dist.DistNetworkError("The server socket has failed to listen on any local network address. "
                           "port: 29511, name: EADDRINUSE, message: address already in use"),
     "another program on it", "dist_timeout_s"),
])
def test_a_store_that_timed_out_names_dist_timeout_s(monkeypatch, failure, says, not_says):
    from fsdp_sync import SyncConfig
    from fsdp_sync.transport import update_group

    def host_store(*a, **k):
        raise failure

    monkeypatch.setattr(update_group, "host_store", host_store)
    cfg = SyncConfig(method="distributed", dist_timeout_s=3.0, dist_master_port=29511,
                     dist_group_name="h89_store")
    with pytest.raises(RuntimeError) as info:
        update_group.open_group([], cfg, torch.device("cpu"), "gloo", pool=None)
    text = str(info.value)
    assert "dist_master_port=29511" in text and says in text and not_says not in text, text
    assert "No engine was told to join" in text, text
