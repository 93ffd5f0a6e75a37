"""Start engine worker processes as fresh interpreters, whatever started the caller.

`start(target, args, name)` runs ``target(conn, *args)`` (``target`` = ``"module:function"``) in a
new ``sys.executable`` process and returns a `WorkerProcess` (``pid``, ``sentinel``, ``exitcode``,
``is_alive``, ``join``, ``terminate``, ``kill``, ``close``: the subset of
``multiprocessing.Process`` the engines use) and the parent's end of a duplex
``multiprocessing.connection.Connection``.

Why not ``multiprocessing``'s spawn context: it re-imports the caller's ``__main__`` in every child,
so a script without an ``if __name__ == "__main__":`` guard runs its top level again in the worker
(which then tries to start an engine of its own and dies), a Ray worker's ``__main__`` is Ray's
own, and a daemonic process may not have children at all. Here the child imports only
``target``'s module, with the caller's ``sys.path``; nothing of ``__main__`` is needed, so engines
start the same from a guarded script, an unguarded one, ``python -c``, a REPL, a notebook, a
daemonic process or a Ray actor.

The child's environment is the caller's minus what a launcher set for the *trainer's* process
group (`launcher_env_names`): torchrun and ``accelerate launch`` export ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_USE_AGENT_STORE=True``; a worker that inherits
the last one joins its own process group as a client of a store nobody serves and times out.
Device selection (``CUDA_VISIBLE_DEVICES``) and everything else is kept, except that torch's
collective flight recorder is off in the workers unless the caller set ``TORCH_FR_BUFFER_SIZE``:
it keeps the last 2000 collectives of every process group for hang dumps (about 1 MiB a group,
filling over the first ~170 syncs of the distributed method), and a worker never dumps it.

A worker started from the main thread dies with the engine's process (Linux's
``PR_SET_PDEATHSIG``, SIGKILL), so a supervisor's SIGKILL of ``fsdp-sync serve`` leaves no worker
behind, not even one stopped or stuck in a collective (one that runs notices its parent gone by
itself, after its current command). Not from another thread: Linux signals when the *thread* that
started the child exits, which for a pool thread may be long before the engine goes. Not under the
forkserver below: there the worker's parent is the server, not the engine's process.

Also `WorkerSet`, the started processes and their pipes, kept apart from the engine so a
finalizer can stop them.

``FSDP_SYNC_WORKERS_START=forkserver`` (the test suite sets it, as it sets
``FSDP_SYNC_RANKS_START``) forks workers from multiprocessing's forkserver instead, which has
imported torch once (`PRELOAD`): a worker then starts in a fraction of a second instead of paying
seconds of imports, which adds up over a test run that starts hundreds. The child takes the same
environment (`worker_env`) and ``sys.path``. Only for a caller whose ``__main__`` is guarded (the
forkserver's children import it, as spawn's do); a daemonic process falls back to a fresh interpreter.
A `cli.launch.run_ranks` rank forks that server from itself when it starts (`prefork_worker_server`):
it has imported torch already, so the server costs a fork instead of a fresh interpreter's imports.
The forkserver's socket lives in a multiprocessing temp directory, which a process removes when it
exits but not when it is killed with its children (Ray SIGKILLs a worker's tree at shutdown), and
an anonymous ``pymp-*`` cannot be told from a live process's: `claim_temp_dir` names it
``pymp-fs<pid>-*``, and `remove_dead_temp_dirs` removes those whose owner is gone. (A fresh
interpreter, the default, makes no such directory.)

Not here: what a worker does (`worker`), or talking to it (`engine`).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Mapping

__all__ = ["WorkerSet", "signame", "WorkerProcess", "start", "worker_env", "launcher_env_names", "LAUNCHER_ENV",
           "LAUNCHER_ENV_PREFIXES", "PRELOAD", "forkserver_usable", "claim_temp_dir",
           "remove_dead_temp_dirs", "TEMP_DIR_PREFIX", "prefork_worker_server"]

PRELOAD = ["torch", "torch.distributed", "fsdp_sync.engines.reference.worker",
           "fsdp_sync.engines.reference.preloaded"]
"""What the forkserver imports once (``FSDP_SYNC_WORKERS_START=forkserver``), in order: `preloaded`
last, which freezes the rest (a quick exit for the server, see there)."""

LAUNCHER_ENV = (
    # torchrun / torch.distributed.elastic, per rank
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    # MPI-style launchers accelerate reads on CPU
    "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_RANK",
    "MV2_COMM_WORLD_SIZE",
    # accelerate launch --cpu pins each rank's OpenMP threads; the workers pick their own
    "KMP_AFFINITY", "KMP_BLOCKTIME",
)
"""Variables a launcher sets for the trainer ranks that must not reach an engine worker."""

LAUNCHER_ENV_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_")

# The child's first lines: take the parent's sys.path, then import and call the target. Only
# builtins are unpickled before sys.path is set.
_BOOT = """\
import os, pickle, sys
from multiprocessing.connection import Connection
_, name, conn_fd, sentinel_fd, parent = sys.argv
os.set_inheritable(int(sentinel_fd), False)
if parent != "0":   # SIGKILL when the engine's process is gone, even stopped or stuck (`start`)
    import ctypes, signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        os._exit(0)     # it went before that
conn = Connection(int(conn_fd))
path, target, blob = pickle.loads(conn.recv_bytes())
sys.path[:] = path
import importlib
module, _, fn = target.partition(":")
getattr(importlib.import_module(module), fn)(conn, *pickle.loads(blob))
import gc
gc.freeze()   # done: the exit skips walking torch's objects (0.8 s that the engine's shutdown waits)
"""


def launcher_env_names(env: Mapping[str, str]) -> list[str]:
    """The names in ``env`` that `worker_env` drops."""
    return sorted(k for k in env if k in LAUNCHER_ENV or k.startswith(LAUNCHER_ENV_PREFIXES))


def worker_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without the launcher's process-group variables, with
    torch's flight recorder off unless ``env`` sets ``TORCH_FR_BUFFER_SIZE``."""
    env = dict(os.environ if env is None else env)
    for k in launcher_env_names(env):
        del env[k]
    env.setdefault("TORCH_FR_BUFFER_SIZE", "0")     # see the module docstring
    return env


class WorkerProcess:
    """A started worker: ``multiprocessing.Process``'s lifecycle methods over ``subprocess.Popen``.

    ``sentinel`` is the read end of a pipe whose only write end the child holds: it becomes
    readable (EOF) when the child exits, so it can be waited on with the worker's connection."""

    def __init__(self, popen: subprocess.Popen, sentinel: int, name: str):
        self._popen, self.sentinel, self.name = popen, sentinel, name
        self.pid = popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while running; the exit status, or -N when killed by signal N."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self._popen.poll() is None:
            self._popen.terminate()

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()

    def close(self) -> None:
        """Release the sentinel fd (the process must have exited)."""
        if self._popen.poll() is None:
            raise ValueError(f"{self.name} (pid {self.pid}) is still running")
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def start(target: str, args: tuple, name: str,
          env: Mapping[str, str] | None = None) -> tuple[WorkerProcess, Connection]:
    """Run ``target(conn, *args)`` in a fresh interpreter (see the module docstring).

    ``args`` are pickled here and unpickled in the child after it has taken this process's
    ``sys.path``, so they may hold anything importable from there. ``env`` defaults to
    `worker_env()`. Raises `RuntimeError` saying what to change when no interpreter can be started.
    """
    how = os.environ.get("FSDP_SYNC_WORKERS_START", "fresh")
    if how not in ("fresh", "forkserver"):
        raise ValueError(f"FSDP_SYNC_WORKERS_START must be 'fresh' or 'forkserver', got {how!r}")
    if how == "forkserver" and forkserver_usable():
        return _start_forked(target, args, name, env)
    exe = sys.executable
    if not exe or not os.path.exists(exe):
        raise RuntimeError(f"cannot start engine worker {name}: this interpreter has no usable "
                           f"sys.executable ({exe!r}; an embedded Python?). Set sys.executable "
                           f"to a python that can import fsdp_sync and torch")
    blob = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
    import socket
    import threading

    # the worker dies with this process (`_BOOT`) where Linux ties it to the process: the death
    # signal fires when the *thread* that started the child exits, and only the main thread lasts
    # as long as the process (an engine built in a pool thread would lose its workers with it)
    tie = sys.platform == "linux" and threading.current_thread() is threading.main_thread()
    parent_sock, child_sock = socket.socketpair()
    sent_r, sent_w = os.pipe()
    try:
        popen = subprocess.Popen(
            [exe, "-c", _BOOT, name, str(child_sock.fileno()), str(sent_w),
             str(os.getpid() if tie else 0)],
            pass_fds=(child_sock.fileno(), sent_w), env=worker_env(env),
            stdin=subprocess.DEVNULL, close_fds=True)
    except BaseException:
        for fd in (sent_r, sent_w):
            os.close(fd)
        parent_sock.close()
        child_sock.close()
        raise
    os.close(sent_w)
    child_sock.close()
    conn = Connection(parent_sock.detach())
    proc = WorkerProcess(popen, sent_r, name)
    try:
        conn.send_bytes(pickle.dumps((list(sys.path), target, blob),
                                     protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:
        pass   # the child died at once: the caller sees it through the sentinel and exit code
    return proc, conn


def forkserver_usable() -> bool:
    """Whether this process can have children forked by multiprocessing's forkserver (engine
    workers here, rank jobs in `cli.launch`)."""
    import multiprocessing as mp
    import tempfile

    # a daemonic process may not have children; a long TMPDIR would pass AF_UNIX's 107 bytes
    # with the server's socket (TMPDIR/pymp-fs<pid>-*/listener-*: 60 + 42)
    return not mp.current_process().daemon and len(tempfile.gettempdir()) <= 60


TEMP_DIR_PREFIX = "pymp-fs"
"""`claim_temp_dir`'s directories: ``pymp-fs<owner pid>-<random>`` in the temp directory."""


def claim_temp_dir() -> str:
    """This process's multiprocessing temp directory (its forkserver's socket goes there), made now
    as ``pymp-fs<pid>-*`` unless it has one already; dead owners' are removed first
    (`remove_dead_temp_dirs`). Called before this process starts a forkserver."""
    import multiprocessing.process as mp_process
    import multiprocessing.util as mp_util
    import shutil
    import tempfile

    config = mp_process.current_process()._config      # where multiprocessing.util keeps it
    if config.get("tempdir") is None:
        remove_dead_temp_dirs()
        path = tempfile.mkdtemp(prefix=f"{TEMP_DIR_PREFIX}{os.getpid()}-")

        def remove(rmtree=shutil.rmtree) -> None:      # as multiprocessing.util does for its own
            rmtree(path, ignore_errors=True)
            if mp_process.current_process() is not None:
                mp_process.current_process()._config["tempdir"] = None

        mp_util.Finalize(None, remove, exitpriority=-100)
        config["tempdir"] = path
    return config["tempdir"]


def remove_dead_temp_dirs(root: str | None = None) -> list[str]:
    """Remove, in ``root`` (default: the temp directory), this user's `claim_temp_dir` directories
    whose owner pid no longer runs and in which no live process has a socket bound (a forked child
    shares its parent's); returns what was removed. Other ``pymp-*`` directories are not touched:
    their owners cannot be told, and removing a live process's breaks its next forkserver."""
    import glob
    import re
    import shutil
    import stat
    import tempfile

    import psutil

    removed: list[str] = []
    bound: set[str] | None = None
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), TEMP_DIR_PREFIX + "*")):
        m = re.fullmatch(re.escape(TEMP_DIR_PREFIX) + r"(\d+)-\w+", os.path.basename(path))
        try:
            st = os.lstat(path)
            if m is None or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() \
                    or psutil.pid_exists(int(m.group(1))):
                continue                # not ours, or its owner (or a process with its pid) runs
            if bound is None:
                bound = {os.path.dirname(c.laddr) for c in psutil.net_connections("unix")
                         if isinstance(c.laddr, str) and c.laddr}
            if path in bound:
                continue
            shutil.rmtree(path)
            removed.append(path)
        except (OSError, psutil.Error):
            continue                    # gone meanwhile, or not allowed to look: keep it
    return removed


def _forks_cannot_use_cuda(torch: Any) -> bool:
    """Whether a fork of this process could not use CUDA: it initialized CUDA, or merely asked
    the driver how many GPUs there are (``torch.cuda.is_available()``, ``device_count()``: torch
    then marks every later fork as a bad fork, "Cannot re-initialize CUDA in forked subprocess",
    while ``is_initialized()`` still says False). The second is seen only in a fork: one is made
    that reports torch's own flag and exits at once. A CPU build of torch has no CUDA to lose."""
    if torch is None:
        return False
    if torch.cuda.is_initialized():
        return True
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return False
    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", None)
    if in_bad_fork is None:
        return True     # a torch that does not say: assume the worst, workers start fresh
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:        # the probe: no Python-level cleanup, nothing of the parent's runs twice
        try:
            os.write(w, b"1" if in_bad_fork() else b"0")
        finally:
            os._exit(0)
    os.close(w)
    try:
        answer = os.read(r, 1)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return answer != b"0"


def prefork_worker_server() -> bool:
    """Under ``FSDP_SYNC_WORKERS_START=forkserver``: give this process its forkserver now, forked
    from this process, instead of the fresh interpreter multiprocessing starts at the first worker
    (which imports torch again: 2.2-2.8 s of a core on 2-core CPU hosts, paid once for every rank job
    of a test run that starts an engine). Called first thing by a `cli.launch.run_ranks` rank,
    while it has no other thread (fork is safe then, as it is in multiprocessing's own server) and
    after it imported what a worker needs (`PRELOAD`). The server is multiprocessing's
    (``multiprocessing.forkserver.main``) and is set as this process's forkserver as
    ``ForkServer.ensure_running`` sets one it started; it ends when this process and the workers it
    forked are gone, with ``os._exit`` (none of this process's exit handlers runs twice).

    Returns whether it did: not without the forkserver start, with a server already running, with
    other threads, once this process initialized CUDA or asked for its GPUs (its forks could not use
    the GPU: `_forks_cannot_use_cuda`, checked after `PRELOAD` is imported), or on a Python whose
    forkserver it does not know (3.14 and later add a handshake); then the first
    worker starts the server as usual."""
    if os.environ.get("FSDP_SYNC_WORKERS_START") != "forkserver" or not forkserver_usable():
        return False
    import importlib
    import inspect
    import socket
    import threading
    import multiprocessing.forkserver as mp_forkserver
    from multiprocessing import connection

    server = mp_forkserver._forkserver
    known = (sys.version_info < (3, 14)
             and list(inspect.signature(mp_forkserver.main).parameters)
             == ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
             and all(hasattr(server, a) for a in ("_forkserver_address", "_forkserver_alive_fd",
                                                  "_forkserver_pid")))
    if not known or server._forkserver_pid is not None or threading.active_count() > 1:
        return False
    for name in PRELOAD:
        importlib.import_module(name)
    if _forks_cannot_use_cuda(sys.modules["torch"]):
        return False    # workers forked from this process could not use the GPU
    claim_temp_dir()                       # the socket goes in this process's named pymp dir
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()           # this process and every worker hold the write end
    pid = os.fork()
    if pid == 0:                           # the server
        code = 0
        try:
            os.close(alive_w)
            mp_forkserver.main(listener.fileno(), alive_r, [])   # preloaded already: this process's
        except SystemExit as exc:          # its way out once every holder of alive_w is gone
            code = exc.code if isinstance(exc.code, int) else 0
        except BaseException:              # noqa: BLE001 - say why, then leave as the server would
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = \
        address, alive_w, pid
    return True


def _forked(conn: Connection, path: list, env: dict, target: str, blob: bytes) -> None:
    """The forked worker's first lines: `_BOOT`'s, with the environment the child must see."""
    import importlib

    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    module, _, fn = target.partition(":")
    getattr(importlib.import_module(module), fn)(conn, *pickle.loads(blob))


def _start_forked(target: str, args: tuple, name: str, env: Mapping[str, str] | None) -> tuple[Any, Connection]:
    """`start` through multiprocessing's forkserver (see the module): the process has the
    lifecycle methods and ``sentinel`` `WorkerProcess` offers."""
    import multiprocessing as mp

    claim_temp_dir()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    blob = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_forked, name=name, daemon=False,
                       args=(child, list(sys.path), worker_env(env), target, blob))
    try:
        proc.start()
    finally:
        child.close()
    return proc, parent


def signame(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f", {signal.Signals(-code).name}"
        except ValueError:
            pass
    return ""


class WorkerSet:
    """The processes and pipes, apart from the engine so a finalizer can stop them."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.closed = False
        self.closing = False    # `stop` is coming: a wait on a worker ends (the engine's `_collect`)
        # the TP workers' rendezvous store (`wire.host_store`, TP > 1), hosted here while they live
        self.store: Any = None
        # TP ranks that did not answer a call within its timeout: nothing more is asked of them
        # (no abort round, no diagnostics) and `stop` ends them without a grace period
        self.silent: set[int] = set()

    def stop(self, grace_s: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps((-1, "shutdown", {})))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace_s
        for r, p in enumerate(self.procs):
            if r not in self.silent:   # a silent worker would not read the shutdown: end it now
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.close()   # releases the sentinel fd
            except ValueError:
                pass
        self.store = None
