"""`fsdp-sync serve --update-recv-timeout-s`: how long the served engine's workers wait in a weight-
update group (joining it, or one broadcast). Before, serve had no such flag: its workers always
waited the engine's 60 s default, so a trainer told to give up sooner could not make the server do so,
and a trainer slower than 60 s between two buckets could not make it wait longer."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from fsdp_sync.cli import app as cli

from test_serve_port import serve_until_up, stop


def test_the_flag_is_checked():
    assert cli.parse_args(["serve", "--update-recv-timeout-s", "2.5"]).update_recv_timeout_s == 2.5
    assert cli.parse_args(["serve"]).update_recv_timeout_s == 60.0
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            cli.parse_args(["serve", "--update-recv-timeout-s", bad])


@pytest.mark.timeout(120)
def test_a_served_engine_gives_up_joining_after_the_flags_seconds():
    """The server is told to join a group at a port where a program that is no torch store listens:
    its workers give up after --update-recv-timeout-s (2 s), not the engine's default 60 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, lines = serve_until_up(port, "--update-recv-timeout-s", "2")
    try:
        assert proc.poll() is None, "".join(lines)
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            other.listen()
            body = {"master_address": "127.0.0.1", "master_port": other.getsockname()[1],
                    "rank_offset": 1, "world_size": 2, "group_name": "g", "backend": "gloo"}
            client = http.client.HTTPConnection("127.0.0.1", port, timeout=90)
            t0 = time.monotonic()
            client.request("POST", "/init_weights_update_group", json.dumps(body),
                           {"Content-Type": "application/json"})
            reply = client.getresponse()
            answer = json.loads(reply.read())
            seconds = time.monotonic() - t0
            client.close()
        assert answer["success"] is False, answer
        assert "did not answer as a torch.distributed store" in answer["message"], answer
        assert 2.0 <= seconds < 20.0, (seconds, answer)
    finally:
        stop(proc)
