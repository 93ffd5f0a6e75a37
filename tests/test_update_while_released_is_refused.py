"""A weight update sent while the engine's weights are released is refused, naming the rank and
what to call first, and the engine takes the same update once the weights are resumed.

With ``release_memory_occupation()`` the weights' memory is given back (no backup here): writing
an update into it would either fail deep inside a copy or fill weights the engine no longer
holds, so the worker refuses the stage itself.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.base import EngineStateError, checksum_named_tensors
from fsdp_sync.models import build_model, load_config


@pytest.mark.timeout(120)
def test_an_update_into_released_weights_is_refused_until_they_are_resumed():
    cfg = load_config("tiny")
    named = [(k, v.detach().clone()) for k, v in build_model(cfg, seed=4).state_dict().items()]
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as engine:
        engine.release_memory_occupation()
        assert engine.memory_stats()["weights_bytes"] == 0
        with pytest.raises(EngineStateError) as info:
            engine.update_weights_from_tensor(named)
        assert ("weights are released on TP rank 0; call resume_memory_occupation(['weights']) "
                "before updating them") in str(info.value)
        engine.resume_memory_occupation(["weights"])
        engine.update_weights_from_tensor(named)
        assert engine.weights_checksum() == checksum_named_tensors(named)
