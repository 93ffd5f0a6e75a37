"""Helpers shared by the tests, the rank bodies (`_ranks`) and the consumer process.

Kept free of pytest so that spawned ranks and `consumer.py` can import it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SEED = 1234


def digest(t: torch.Tensor) -> list:
    """[dtype, shape, sha256 of the raw bytes]: equal digests mean bit-identical tensors."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest()]


def digests(named) -> dict[str, list]:
    return {n: digest(t) for n, t in named}


_HELPERS = ("torch_shm_manager", "multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Long-lived helpers that torch and multiprocessing start (tests/conftest.py knows them too)."""


def session_leftovers(sid: int, grace_s: float = 3.0) -> list[str]:
    """The processes of session ``sid`` still running after ``grace_s``, but for the helpers.

    A helper outlives the command that started it by design (``torch_shm_manager`` 2 s after its
    last client, a forkserver and resource tracker as long as it holds their pipes). A process
    forked *by* a forkserver has the server's command line, and is no helper: a rank or engine
    worker left behind."""
    import time

    import psutil

    def left() -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) != sid or p.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmd = " ".join(p.cmdline())
                parent = p.parent()
                forked = parent is not None and " ".join(parent.cmdline()) == cmd
                if forked or not any(h in cmd for h in _HELPERS):
                    out.append(p)
            except (psutil.Error, OSError):
                continue   # gone meanwhile
        return out

    deadline = time.monotonic() + grace_s
    while (procs := left()) and time.monotonic() < deadline:
        time.sleep(0.05)
    desc = []
    for p in procs:
        try:
            desc.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            pass
    return desc


def run_output(cmd: list[str], *, timeout: float, **kw) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=...)`, done once ``cmd`` exits
    and nothing it started but the helpers runs (`session_leftovers`: else an AssertionError).

    Its output goes through unnamed temporary files, not pipes: a pipe's end is reached only when
    every process holding it is gone, and a child's ``torch_shm_manager`` (started by torch with
    the child's file descriptors, its stdout included) stays 2 s after its last client leaves,
    the multiprocessing helpers it keeps open with it. The caller would wait for them. The
    child runs in a session of its own, so what it leaves is found though its parent is gone.
    On the timeout the session is killed and `subprocess.TimeoutExpired` raised."""
    import signal
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True, **kw) as proc:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    left = session_leftovers(proc.pid)
    assert not left, f"{' '.join(map(str, cmd))[:200]} left {len(left)} process(es) running: {left}"
    return subprocess.CompletedProcess(cmd, proc.returncode, *texts)


def cli_here(capsys, *argv: str) -> subprocess.CompletedProcess:
    """``fsdp-sync ARGV`` through `cli.main` in this (test) process, its output read from pytest's
    ``capsys``: as `run_output` reports a child's. Its ranks fork from this process's forkserver,
    which has imported torch and transformers already, where a fresh ``python -m fsdp_sync.cli``
    spends 8 s of CPU on them and its own imports; the command itself is run as a child by the
    tests that check it as such (test_demo_methods, test_bench_cli_rows_json_and_plots, ...)."""
    from fsdp_sync.cli import app

    capsys.readouterr()                 # what the test printed before is not the command's
    try:
        rc = app.main(list(argv))
    except SystemExit as exc:           # argparse's refusals (exit 2) exit as the command would
        rc = exc.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["fsdp-sync", *argv], rc, out, err)


def shm_segments(descendants: set[int] | None = None) -> set[str]:
    """torch's shared-memory segments that may be this test's: made by this process, one of its
    children, or a process that is gone. torch names them ``torch_<creator pid>_...``; a segment
    of a live process outside this tree belongs to a test running beside this one (``make test``
    runs two at a time) or another session's. ``descendants``: this process's descendants' pids
    from a scan the caller just made (conftest's check, once per test: a scan reads every
    process's /proc entry); None: scanned here, and only when there is a segment to judge."""
    import psutil

    try:
        names = {f for f in os.listdir("/dev/shm") if f.startswith("torch_")}
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()
    if not names:
        return set()
    if descendants is None:
        descendants = {p.pid for p in psutil.Process().children(recursive=True)}
    mine = {os.getpid(), *descendants}
    out = set()
    for name in names:
        parts = name.split("_")
        pid = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else None
        if pid is None or pid in mine or not psutil.pid_exists(pid):
            out.add(name)
    return out


def own_segments() -> int:
    """How many of torch's /dev/shm segments this process made (``torch_<pid>_...``)."""
    mine = f"torch_{os.getpid()}_"
    return sum(n.startswith(mine) for n in os.listdir("/dev/shm"))


def own_segments_left(before: int, wait_s: float = 5.0) -> int:
    """This process's segments made since ``before`` (an `own_segments` count) still there: what
    torch frees is unlinked a moment later on a loaded machine (conftest's leak check waits 5 s
    too); what is kept never goes."""
    import time

    deadline = time.monotonic() + wait_s
    while (n := own_segments() - before) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def start_serve(*args: str, stderr=subprocess.STDOUT, wait_s: float = 90.0,
                env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``fsdp-sync serve --port 0 ARGS`` as a child, and its URL once it listens (read from the line
    it prints). The caller stops it (``terminate``/``kill`` and ``wait``)."""
    import time

    env = dict(env or dict(os.environ, PYTHONPATH=str(ROOT)))
    # serve starts its workers as a user's does: fresh interpreters, named in their command line
    env.pop("FSDP_SYNC_WORKERS_START", None)
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_sync.cli", "serve", "--port", "0", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    line, deadline = "", time.monotonic() + wait_s
    while "http://" not in line and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
    if "http://127.0.0.1:" not in line:
        proc.kill()
        proc.wait(30)
        raise AssertionError(f"fsdp-sync serve {' '.join(args)} did not print its URL: {line!r}")
    return proc, line.split(" on ", 1)[1].split()[0]


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- models

def perturb_(params) -> None:
    """The same elementwise update on shards and on full tensors (bit-identical either way): the
    export must read live values, not a stale copy taken at wrap time."""
    with torch.no_grad():
        for p in params:
            p.mul_(1.5).add_(0.25)


def reference(recipe: str, dtype: torch.dtype | None, *, seed: int = SEED,
              tied_alias: str | None = None) -> dict[str, list]:
    """Digests of the unsharded model's state_dict (HF names), perturbed, cast to ``dtype``.

    ``tied_alias`` is the key a tied checkpoint leaves out; it must be the same tensor as another.
    """
    from fsdp_sync.models import build_model, load_config

    model = build_model(load_config(recipe), seed=seed)
    perturb_(model.parameters())
    sd = model.state_dict()
    if tied_alias is not None:
        alias = sd.pop(tied_alias)
        assert any(v.data_ptr() == alias.data_ptr() for v in sd.values()), "not tied"
    return {k: digest(v if dtype is None else v.to(dtype)) for k, v in sd.items()}


class Odd(nn.Module):
    """Shapes that split unevenly (trailing ranks hold 0 rows at 4 ranks), a 1-row parameter, a
    persistent int buffer, a persistent non-weight buffer and a non-persistent one."""

    def __init__(self, seed: int = SEED) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.c = nn.Parameter(torch.randn(1, 7))
        self.a = nn.Linear(3, 5)          # weight rows 5 -> 2,2,1,0 on 4 ranks
        self.b = nn.Embedding(9, 4)       # 3,3,3,0
        self.d = nn.Linear(4, 3, bias=False)   # 1,1,1,0
        self.register_buffer("step", torch.tensor([7, -3], dtype=torch.int64))
        self.register_buffer("inv_freq", torch.arange(4.0))          # computed, not a weight
        self.register_buffer("scratch", torch.ones(2), persistent=False)


ODD_NAMES = ["c", "step", "a.weight", "a.bias", "b.weight", "d.weight"]


def odd_reference(dtype: torch.dtype | None) -> dict[str, list]:
    m = Odd()
    perturb_(m.parameters())
    sd = m.state_dict()
    del sd["inv_freq"]
    out = {}
    for k, v in sd.items():
        out[k] = digest(v.to(dtype) if dtype is not None and v.is_floating_point() else v)
    assert list(out) == ODD_NAMES
    return out


# --------------------------------------------------------------------------- consumer process

class Consumer:
    """An independent process (`tests/consumer.py`, started with subprocess, not multiprocessing)
    that opens payloads the way an engine's TP worker does and reports what it rebuilt."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "consumer.py")], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)

    def request(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"consumer exited with code {self.proc.wait(5)}")
        return json.loads(line)

    def open(self, payloads, *, ranks=None, names=None, ack: bool = True, twice: bool = False,
             keep: bool = False) -> list:
        """Open each payload (bytes or base64 str) as ``ranks[i]``; a result per payload:
        ``{"tensors": {name: digest}}`` or ``{"error": "..."}``. ``keep``: the consumer holds what
        it opened until `drop` (results then carry ``"ptr"``, the storage's address there)."""
        items = []
        for i, p in enumerate(payloads):
            is_str = isinstance(p, str)
            items.append({"payload": p if is_str else base64.b64encode(p).decode("ascii"),
                          "str": is_str, "rank": None if ranks is None else ranks[i],
                          "name": None if names is None else names[i]})
        return self.request({"op": "open", "items": items, "ack": ack, "twice": twice,
                             "keep": keep})["results"]

    def drop(self) -> None:
        """Let go of everything opened with ``keep``."""
        self.request({"op": "drop"})

    def stats(self) -> dict:
        return self.request({"op": "stats"})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:  # pragma: no cover
                pass

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- multi-process sync jobs

class Refusing:
    """``engine`` as an engine that does not take some per-rank data: each attribute named in
    ``refuses`` (e.g. ``accepts_rank_checkpoints``, as SGLang 0.5.23 answers) reads False, the rest
    is the engine's."""

    def __init__(self, engine, refuses: tuple[str, ...]) -> None:
        self._engine, self._refuses = engine, frozenset(refuses)

    def __getattr__(self, name):
        return False if name in self._refuses else getattr(self._engine, name)


def run_syncs(rank: int, case: int, module, opt, cfg, engine, syncs, *, prompts, refuses,
              make_manager, drop_extra=(), watch=None, after_sync=None, greedy: int = 0) -> list[dict]:
    """One training step and one sync per entry of ``syncs`` (SyncConfig overrides) on ``module``,
    a record per sync; ``engine`` (None on ranks that hold none) is shut down at the end.

    An entry's ``"engine"`` key hands the sync ``Refusing(engine, refuses)`` (an engine that does
    not take per-rank data) instead of the engine; ``make_manager(wrapped, step, kw)`` builds the manager.
    A record: ``case``, ``step``, ``kw`` (the overrides less ``"engine"``) and ``extra`` (the
    manager's stats.extra less ``drop_extra``); where an engine is held, ``exact`` (its weights equal
    the trainer's bit for bit) and ``diff`` (largest logit difference to the trainer's forward on
    ``prompts``), then what ``after_sync(manager, rec)`` adds. A SyncError instead: ``error``,
    ``kept`` (the engine still serves the weights it had; None without an engine) and, with
    ``watch`` (a callable reading state a refused sync must not touch), ``unchanged``.
    ``greedy``: also ``tokens`` (the engine's greedy tokens, that many per prompt, equal the
    trainer's own greedy generation; every rank runs the trainer's, a collective under FSDP).
    """
    from fsdp_sync.weights import export
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.topology import SyncError
    from fsdp_sync.cli.trainer import greedy_generate, last_logits, synthetic_batch, train_step

    out = []
    try:
        for step, kw in enumerate(syncs):
            kw = dict(kw)
            wrapped = engine if kw.pop("engine", None) is None or engine is None else Refusing(engine, refuses)
            train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
            before = engine.weights_checksum() if engine is not None else None
            watched = watch() if watch is not None else None
            manager = make_manager(wrapped, step, kw)
            rec = {"case": case, "step": step, "kw": kw}
            try:
                with manager:
                    ref = last_logits(module, prompts)
                    want = greedy_generate(module, prompts, greedy) if greedy else None
                    trainer = checksum_named_tensors(export.iter_params(module, dtype=torch.float32))
                    rec["extra"] = {k: v for k, v in manager.stats.extra.items() if k not in drop_extra}
                    rec["seconds"], rec["engine_calls"] = manager.stats.seconds, manager.stats.engine_calls
                    if engine is not None:
                        rec["exact"] = engine.weights_checksum() == trainer
                        rec["diff"] = float((engine.forward_logits(prompts).float() - ref).abs().max())
                        if greedy:
                            rec["tokens"] = engine.generate(prompts, max_new_tokens=greedy, ignore_eos=True) == want
                        if after_sync is not None:
                            after_sync(manager, rec)
            except SyncError as exc:
                rec["error"] = str(exc)
                rec["kept"] = engine.weights_checksum() == before if engine is not None else None
                if watch is not None:
                    rec["unchanged"] = watch() == watched
            finally:
                manager.close()
            out.append(rec)
    finally:
        if engine is not None:
            engine.shutdown()
    return out


def fds_under(pid: int, root: str) -> list[str]:
    """What process ``pid`` holds open under ``root`` (files and directories, from /proc), sorted."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root):
            out.add(target)
    return sorted(out)


def timed_sync(manager) -> tuple[str | None, float]:
    """One ``with manager:`` block: ``(None or "Type: message" of what it raised, seconds)``."""
    import time

    t0 = time.monotonic()
    try:
        with manager:
            pass
        return None, time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0


def post_json(srv, path: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    """POST ``body`` as JSON to an in-process `EngineServer` ``srv``: ``(status, answer)``."""
    import http.client
    import json

    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()
