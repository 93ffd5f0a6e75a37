"""examples/fleet_router.py's clients against a stand-in router (no sglang-router needed): an
answer cut off by a replica taken out of service (200, finish reason ``abort``, the tokens it had)
is counted as aborted and sent again, never as served; an answer short of its tokens for another
reason is a problem. Before, every 200 was served: the 4 answers the drain cut off (1 to 19 of 24
tokens) in /tmp/audit/fleet2/example_short.out were in 'served 2355 ... failed 0'."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from _util import ROOT


def _example():
    spec = importlib.util.spec_from_file_location("fleet_router", ROOT / "examples" / "fleet_router.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Router(BaseHTTPRequestHandler):
    """Answers the n-th /generate as ``plan[n]`` says: ("abort", tokens) or ("length", tokens)."""

    plan: list[tuple[str, int]] = []
    calls = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            finish, n = self.plan[min(type(self).calls, len(self.plan) - 1)]
            type(self).calls += 1
        assert body["sampling_params"]["max_new_tokens"] == 24
        data = json.dumps({"output_ids": [7] * n, "meta_info": {
            "finish_reason": {"type": finish},
            "weight_versions": [{"version": "0", "start": 0, "end": n}] if n else []}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _run(plan: list[tuple[str, int]], requests: int) -> tuple[dict, list[str]]:
    fleet = _example()
    _Router.plan, _Router.calls = plan, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        clients = fleet.Clients(f"http://127.0.0.1:{httpd.server_address[1]}", 1, requests)
        for t in clients.threads:
            t.join(30)
        problems: list[str] = []
        return fleet.tally(clients.stop(), {"default", "0"}, problems), problems
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_answer_cut_off_is_aborted_and_sent_again_not_served():
    # request 1 cut off twice (8, then 0 tokens), then whole; request 2 whole at once
    out, problems = _run([("abort", 8), ("abort", 0), ("length", 24), ("length", 24)], requests=2)
    assert _Router.calls == 4
    assert (out["requests"], out["served"], out["failed"], out["aborted"]) == (2, 2, 0, 2), out
    assert out["tokens"] == 48 and problems == [], (out, problems)


def test_an_answer_cut_off_every_time_fails_and_a_short_one_is_a_problem():
    out, problems = _run([("abort", 3)], requests=1)          # sent 4 times, cut off each time
    assert _Router.calls == 4
    assert (out["served"], out["failed"], out["aborted"]) == (0, 1, 3), out
    assert any("1 requests failed" in p and "abort" in p for p in problems), problems
    out, problems = _run([("length", 19)], requests=1)        # 200, not cut off, yet short
    assert out["served"] == 1 and any("1 responses came short of 24 tokens" in p for p in problems), problems
