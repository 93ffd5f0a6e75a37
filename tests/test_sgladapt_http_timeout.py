"""`HttpClient.request`'s ``timeout_s`` bounds that call, on a kept-alive connection as through
urllib (a proxy): a call given 0.3 s against a server that answers after 5 s gives up in about
0.3 s, not after the client's 30 s default."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fsdp_sync.engines.sglang.client import HttpClient, SGLangHTTPError

pytestmark = pytest.mark.timeout(60)


class Slow(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        time.sleep(5 if self.path == "/slow" else 0)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


@pytest.mark.parametrize("keepalive_s", [2.0, 0.0])
def test_a_calls_own_timeout_bounds_it(keepalive_s):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        c = HttpClient(f"http://127.0.0.1:{srv.server_address[1]}", api_key=None, timeout_s=30.0,
                       max_retries=0, backoff_s=0.01, backoff_max_s=0.01, proxies=None,
                       keepalive_s=keepalive_s)
        assert c.request("GET", "/fast")[0] == 200
        t0 = time.monotonic()
        with pytest.raises(SGLangHTTPError, match="no answer"):
            c.request("GET", "/slow", timeout_s=0.3)
        assert time.monotonic() - t0 < 3.0
        c.close()
    finally:
        srv.shutdown()
        srv.server_close()
