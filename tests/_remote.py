"""A reference engine served to other processes (test helper): the engine and its workers live in
the test process, outside the trainer's world, and trainer rank 0 drives it through a
`multiprocessing.managers` proxy, so killing a trainer rank leaves the engine running."""

from __future__ import annotations

import threading
from multiprocessing.managers import BaseManager

_METHODS = ["init_weights_update_group", "update_weights_from_distributed",
            "destroy_weights_update_group", "begin_weight_update", "end_weight_update",
            "flush_cache", "weights_checksum", "get_tp_size"]


class _Served:
    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def get_tp_size(self) -> int:
        return self.engine.tp_size

    def end_weight_update(self, abort: bool = False) -> None:
        return self.engine.end_weight_update(abort=abort)


class EngineServer:
    """Serve ``engine`` on 127.0.0.1 from a thread of this process; `address`/`authkey` connect."""

    def __init__(self, engine) -> None:
        served = _Served(engine)

        class _M(BaseManager):
            pass

        _M.register("engine", callable=lambda: served, exposed=_METHODS)
        self.authkey = b"fsdp-sync-test"
        self._server = _M(address=("127.0.0.1", 0), authkey=self.authkey).get_server()
        self.address = self._server.address
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._server.serve_forever()
        except SystemExit:      # serve_forever ends with sys.exit(0), meant for a process of its own
            pass

    def close(self) -> None:
        self._server.stop_event.set()
        self._thread.join(timeout=5)
        try:
            self._server.listener.close()
        except OSError:
            pass


class RemoteEngine:
    """Client side: what the distributed transport calls, forwarded over the proxy."""

    def __init__(self, address, authkey: bytes) -> None:
        class _M(BaseManager):
            pass

        _M.register("engine")
        m = _M(address=tuple(address), authkey=authkey)
        m.connect()
        self._proxy = m.engine()
        self.tp_size = self._proxy.get_tp_size()

    def __getattr__(self, name):
        if name not in _METHODS:
            raise AttributeError(name)
        return getattr(self._proxy, name)

    def end_weight_update(self, abort: bool = False) -> None:
        return self._proxy.end_weight_update(abort)
