"""``fsdp-sync bench --engine http``: a job's reference engine behind `fsdp-sync serve`'s server
on loopback, so the tensor rows pay what an HTTP engine costs (SGLang's wire).

Not here: the rows (`main`), the server itself (`engines.reference.serve`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Served"]


class Served:
    """The job's engine behind `EngineServer` on loopback, and the `SGLangEngine` client the
    manager gets instead of the engine."""

    def __init__(self, engine: Any, tp: int) -> None:
        from ...engines.reference.serve import EngineServer
        from ...engines.sglang import SGLangEngine

        self.server = EngineServer(engine).start()
        self.client = SGLangEngine(base_url=self.server.url, tp_size=tp, max_retries=0)

    def close(self) -> None:
        try:
            self.client.shutdown()
        finally:
            self.server.close()
