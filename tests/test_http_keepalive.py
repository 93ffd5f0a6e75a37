"""`HttpClient` keeps its connection alive across a sync's calls, and never sends a request twice.

A sync over HTTP is begin, one call per bucket, end and a flush: each used to pay a TCP handshake
and a new server thread. These check, against `fsdp-sync serve`'s server over a real reference
engine: one connection carries a whole sync (and the weights arrive); a connection the server
closed while idle, or one idle past ``keepalive_s``, is replaced before the request goes out (the
server counts each call once); and a closed server answers nothing more over a kept connection.
"""

from __future__ import annotations

import time

import pytest
import torch

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.sglang import SGLangEngine
from fsdp_sync.engines.sglang.client import SGLangError

NAME = "model.norm.weight"


def _sync(client: SGLangEngine, value: float) -> None:
    shape = tuple(client.get_weights_by_name(NAME).shape)
    client.begin_weight_update()
    client.update_weights_from_bucket([(NAME, torch.full(shape, value))], flush_cache=False)
    client.end_weight_update()
    client.flush_cache()


@pytest.mark.timeout(120)
def test_one_connection_carries_every_call_of_a_sync_and_the_next():
    with ReferenceEngine("tiny", tp_size=1) as eng, EngineServer(eng) as srv:
        client = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        try:
            _sync(client, 3.0)
            _sync(client, 4.0)
            assert float(eng.get_weights_by_name(NAME)[0]) == 4.0
            assert srv.hits["/update_weights_from_tensor"] == 2
            assert client._http.connections == 1      # 2 syncs, 10 requests, one connection
        finally:
            client.shutdown()


@pytest.mark.timeout(120)
def test_a_connection_the_server_closed_is_replaced_and_the_call_sent_once():
    # the server drops a connection idle for 0.3 s; the client would keep it 2 s
    with ReferenceEngine("tiny", tp_size=1) as eng, EngineServer(eng, socket_timeout_s=0.3) as srv:
        client = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        try:
            _sync(client, 3.0)
            time.sleep(1.0)                           # the server's handler timed out and closed it
            _sync(client, 5.0)                        # begin is not idempotent: no retry allowed
            assert float(eng.get_weights_by_name(NAME)[0]) == 5.0
            assert client._http.connections == 2
            assert srv.hits["/begin_weight_update"] == 2 and srv.hits["/end_weight_update"] == 2
        finally:
            client.shutdown()


@pytest.mark.timeout(120)
def test_a_connection_idle_past_keepalive_is_not_reused():
    with ReferenceEngine("tiny", tp_size=1) as eng, EngineServer(eng) as srv:
        client = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        try:
            client._http.keepalive_s = 0.2
            client.flush_cache()
            client.flush_cache()
            assert client._http.connections == 1
            time.sleep(0.4)
            client.flush_cache()
            assert client._http.connections == 2
        finally:
            client.shutdown()


@pytest.mark.timeout(120)
def test_a_closed_server_serves_nothing_over_a_kept_connection():
    with ReferenceEngine("tiny", tp_size=1) as eng:
        srv = EngineServer(eng).start()
        client = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        try:
            _sync(client, 3.0)
            srv.close()
            shape = tuple(eng.get_weights_by_name(NAME).shape)
            with pytest.raises(SGLangError):
                client.begin_weight_update()
            with pytest.raises(SGLangError):
                client.update_weights_from_bucket([(NAME, torch.full(shape, 7.0))])
            assert float(eng.get_weights_by_name(NAME)[0]) == 3.0     # nothing applied
            assert srv.hits["/begin_weight_update"] == 1
        finally:
            client.shutdown()
            srv.close()


def test_keepalive_zero_is_a_connection_per_request_and_negative_is_refused():
    from fsdp_sync.engines.sglang.client import HttpClient

    kw = dict(api_key=None, timeout_s=5.0, max_retries=0, backoff_s=0.1, backoff_max_s=1.0,
              proxies=None)
    with pytest.raises(ValueError, match="keepalive_s must be >= 0"):
        HttpClient("http://127.0.0.1:1", keepalive_s=-1.0, **kw)
    with ReferenceEngine("tiny", tp_size=1) as eng, EngineServer(eng) as srv:
        client = HttpClient(srv.url, keepalive_s=0.0, **kw)
        for _ in range(3):
            assert client.request("POST", "/flush_cache")[0] == 200
        assert client.connections == 0 and srv.hits["/flush_cache"] == 3   # urllib's, one each


@pytest.mark.timeout(120)
def test_both_ends_of_a_kept_connection_send_without_waiting_for_an_ack():
    """An answer is written as head then body: with Nagle's algorithm on, the body of every answer
    on a kept-alive connection waited for the client's delayed ACK (40 ms a request)."""
    import socket

    with ReferenceEngine("tiny", tp_size=1) as eng, EngineServer(eng) as srv:
        client = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        try:
            client.flush_cache()
            (conn, _), = client._http._idle
            assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            served = list(srv._conns)
            assert served and all(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in served)
        finally:
            client.shutdown()
