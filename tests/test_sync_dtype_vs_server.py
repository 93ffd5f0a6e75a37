"""`SyncConfig.dtype` other than an SGLang server's explicit ``--dtype`` is refused before the
first sync sends anything, naming both (`config_check.sync_refusal` passes the dtype to
`SGLangEngine.sync_refusal`): SGLang's loader would cast every tensor again (bfloat16 into float16
overflows past 65504) and the engine would not hold the trainer's weights. H86 added the engine's
side; the manager's check did not pass the dtype, so nothing asked it."""

from __future__ import annotations

import pytest
import torch

import fake_sglang as fake


@pytest.mark.timeout(60)
def test_a_sync_dtype_other_than_the_servers_is_refused_before_anything_is_sent(one_rank):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.topology import make_mesh

    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    with fake.FakeSGLangServer(tp_size=1) as srv:
        info = srv.engine.get_server_info
        srv.engine.get_server_info = lambda: {**info(), "dtype": "float16"}
        for dtype, refused in ((torch.bfloat16, True), (torch.float16, False)):
            eng = sg.SGLangEngine(base_url=srv.url)
            cfg = SyncConfig(dtype=dtype, method="tensor", memory_probe="off", free_cache_engine=False)
            m = FSDPShardingManager(module, eng, mesh=make_mesh(1, 1), config=cfg)
            try:
                if refused:
                    with pytest.raises(Exception) as err:
                        with m:
                            pass
                    msg = str(err.value)
                    assert "--dtype float16" in msg and "SyncConfig.dtype=torch.bfloat16" in msg, msg
                    assert srv.hits.get("/update_weights_from_tensor", 0) == 0        # nothing sent
                else:
                    with m:
                        pass
                    assert torch.equal(srv.engine.weights["weight"], module.weight.detach().half())
            finally:
                m.close()
                eng.shutdown()
