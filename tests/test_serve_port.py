"""`fsdp-sync serve` started again on the port the last one served: a port left in TIME-WAIT by
a clean stop is free to it, as it is to the HTTP server itself (allow_reuse_address). Before, its
port check bound without SO_REUSEADDR and refused the port for about a minute after any stop that
had answered a kept-alive client ('argument --port: cannot bind ... Address already in use')."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fsdp_sync.cli import app as cli

from _util import ROOT


def _port_in_time_wait() -> int:
    """A port with no listener left, but a connection of its own in TIME-WAIT: the server side
    closed first, as a stopped server does to a kept-alive client."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()                  # the server's side closes first: it is the one in TIME-WAIT
        client.recv(1)                # its FIN reached the client
        client.close()
    time.sleep(0.1)
    with socket.socket() as plain, pytest.raises(OSError):   # the state the check tripped over
        plain.bind(("127.0.0.1", port))
    return port


def test_serve_takes_a_port_left_in_time_wait():
    port = _port_in_time_wait()
    args = cli.parse_args(["serve", "--port", str(port)])
    assert args.port == port


def test_serve_still_refuses_a_port_another_socket_listens_on(capsys):
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # even one that allows reuse
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            cli.parse_args(["serve", "--port", str(port)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and f"argument --port: cannot bind 127.0.0.1:{port}" in err, err


def serve_until_up(port: int, *flags: str) -> tuple[subprocess.Popen, list[str]]:
    """`fsdp-sync serve --port PORT FLAGS` in a session of its own, once it says where it serves
    (or has exited); with the lines it printed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_sync.cli", "serve", "--port", str(port), *flags],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "http://" in line:
            return proc, lines
    proc.wait(timeout=30)
    return proc, lines


@pytest.mark.timeout(120)
def test_serve_restarts_on_its_port_after_a_clean_stop_with_a_kept_alive_client():
    import http.client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = second = None
    try:
        first, lines = serve_until_up(port)
        assert first.poll() is None, "".join(lines)
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        client.request("GET", "/get_model_info")
        assert client.getresponse().read() and True
        first.send_signal(signal.SIGTERM)       # the client keeps its connection open meanwhile
        first.communicate(timeout=60)
        client.close()
        assert first.returncode == 0
        second, lines = serve_until_up(port)
        assert second.poll() is None and any(f":{port}" in x for x in lines), "".join(lines)
    finally:
        for proc in (first, second):
            stop(proc)


def stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM to a `serve_until_up` server's session, SIGKILL after a minute."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
