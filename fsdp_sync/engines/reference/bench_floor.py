"""The benchmark floor on a reference worker: bare broadcasts of the update group, received and
dropped, so `fsdp-sync bench` can set the transport's cost apart from loading.

Not here: real weight updates (`staging`, `worker.receive_broadcast`), the bench command (`cli`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["receive_raw"]


def receive_raw(device: torch.device, group: Any, nbytes: int, count: int, *, p2p: bool = False) -> None:
    """Receive ``count`` messages of ``nbytes`` from the group's rank 0 into one reused buffer."""
    import torch.distributed as dist

    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(count):
        if p2p:   # the per-rank floor: one point-to-point message each
            dist.recv(buf, group=group, group_src=0)
        else:
            dist.broadcast(buf, src=0, group=group)
