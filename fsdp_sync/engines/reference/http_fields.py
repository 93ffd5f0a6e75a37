"""The checks `fsdp-sync serve` applies to a JSON request body, shared by its route modules: a
refusal with its HTTP status (`Refused`), the status of an error a route raised (`error_status`:
4xx the client's mistake, 5xx the server's), typed fields that name themselves when wrong (400),
the disk-update path rule, which keyword arguments an engine method takes, and the reading of a
chunked request body (`read_chunked`).

Not here: the routes (`serve`, `serve_control`), the ``/generate`` body (`generate_request`).
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..base import (UNOPENED_MARK, EngineClosedError, EngineStateError, EngineUnavailableError,
                    WorkerDiedError)

__all__ = ["Refused", "unopened", "error_status", "error_text", "body_field", "str_list_field", "tags_field", "check_disk_path",
           "accepted_kwargs", "type_names", "opened_payloads", "read_chunked", "too_big"]


class Refused(Exception):
    """A request refused with ``status`` and a ``{success: false, message}`` body (and
    ``headers``, e.g. a 405's ``Allow``); with ``plain`` the body is ``message`` alone, as text
    (where SGLang answers bare text: a refused ``/flush_cache``)."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None,
                 plain: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})
        self.plain = plain


def error_status(exc: BaseException) -> tuple[int, bool]:
    """``(HTTP status, retryable)`` for an error a route raised. Retryable: the request was fine
    and the same request may succeed later or on another server (a router retries it there).

    - `Refused`: its own status; retryable when 503.
    - The engine cannot serve now: `EngineUnavailableError` (weights or KV cache released, out of
      service, busy past the wait limit), `WorkerDiedError`, `EngineClosedError` (shut down, e.g.
      at SIGTERM): 503, retryable.
    - The request does not fit: ``ValueError`` (`WeightUpdateError` among them), ``KeyError``,
      ``TypeError``, `EngineStateError` (an update outside begin/end, begin twice): 400.
    - Anything else is the server's fault: 500, not retryable (it may fail the same way)."""
    if isinstance(exc, Refused):
        return exc.status, exc.status == 503
    if isinstance(exc, (EngineUnavailableError, WorkerDiedError, EngineClosedError)):
        return 503, True
    if isinstance(exc, (ValueError, KeyError, TypeError, EngineStateError)):
        return 400, False
    return 500, False


def unopened(exc: Refused) -> Refused:
    """``exc`` saying that none of the request's payloads was opened (`base.UNOPENED_MARK`): the
    sender may give their shared-memory references back at once."""
    if UNOPENED_MARK in str(exc):
        return exc
    return Refused(exc.status, f"{exc}; {UNOPENED_MARK}", headers=exc.headers, plain=exc.plain)


def error_text(exc: BaseException) -> str:
    """``exc``'s message for an answer (a KeyError's without the quotes ``str`` adds)."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def type_names(types: type | tuple) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


def body_field(body: dict, key: str, types: type | tuple, default: Any = ..., *,
               optional: bool = False) -> Any:
    """``body[key]`` if it has one of ``types`` (a bool is not an int here); ``default`` when
    missing (or null with ``optional``); `Refused` 400 naming the field otherwise."""
    if key not in body or (optional and body[key] is None):
        if default is ...:
            raise Refused(400, f"missing field {key!r}")
        return default
    v = body[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise Refused(400, f"field {key!r} must be {type_names(types)}, got bool")
    if not isinstance(v, types):
        raise Refused(400, f"field {key!r} must be {type_names(types)}, got {type(v).__name__}")
    return v


def str_list_field(body: dict, key: str) -> list[str]:
    v = body_field(body, key, list)
    if not all(isinstance(x, str) for x in v):
        raise Refused(400, f"field {key!r} must be a list of strings")
    return v


def tags_field(body: dict) -> list[str] | None:
    tags = body_field(body, "tags", (list, type(None)), None)
    if tags is not None and not all(isinstance(t, str) for t in tags):
        raise Refused(400, "field 'tags' must be a list of strings or null")
    return tags


def check_disk_path(path: Any, allowed: Sequence[str | os.PathLike], *, field: str = "model_path",
                    what: str = "update_weights_from_disk") -> Path:
    """``path`` resolved (symlinks followed) if it lies inside one of ``allowed``; else `Refused`,
    naming the body's ``field`` and the route's ``what`` (``lora_path`` of ``load_lora_adapter``).

    A path that does not exist is refused too (SGLang would take it for a Hub repo id and try to
    download it)."""
    if not isinstance(path, str) or not path:
        raise Refused(400, f"{field} must be a non-empty string, got {type(path).__name__}")
    if not allowed:
        raise Refused(403, f"{what} is disabled: the server was started without --allowed-disk-dir")
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        raise Refused(400, f"{field} {path!r} is not an existing local path") from None
    for root in allowed:
        root = Path(root).resolve()
        if real == root or root in real.parents:
            return real
    raise Refused(403, f"{field} {path!r} (resolved {str(real)!r}) is outside the allowed "
                       f"directories {[str(Path(r).resolve()) for r in allowed]}")


def accepted_kwargs(fn: Callable, kwargs: dict) -> dict:
    """``kwargs`` less the keys ``fn`` does not take (SGLang's bodies carry more than some engines
    accept; the keys dropped are optional ones with defaults)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


@contextmanager
def opened_payloads(payloads: Sequence[Any], label: str) -> Iterator[list]:
    """The values of a request's serialized payloads (`weights.handles.open_payload`), every one
    opened, and every one opened acknowledged when the block ends, failed or not (each holds a
    shared-memory reference its sender counted on its consumer to take). One that cannot be
    opened is a 400 naming it (the first such: ``label`` with ``{i}`` for its index), raised after
    every other one was opened and acknowledged: an untagged payload (SGLang's format: no state
    word its sender could revoke) left unopened behind a bad one kept the reference its pickling
    took for this consumer, so its /dev/shm segment outlived the sender's tensors until the
    sender's process exited (one segment per failed request). The refusal carries text only, and
    the acknowledged list is emptied, so no traceback holding this frame keeps an opened tensor."""
    from ...weights import handles

    opened, refusal = [], None
    try:
        for i, p in enumerate(payloads):
            try:
                opened.append(handles.open_payload(p))
            except Exception as exc:  # noqa: BLE001 - what the client sent cannot be opened
                refusal = refusal or f"{label.format(i=i)}: {type(exc).__name__}: {exc}"
        if refusal is not None:
            raise Refused(400, refusal)
        yield [r.value for r in opened]
    finally:
        handles.ack_all(opened)   # waits for the copies out of CUDA payloads, then acknowledges
        opened.clear()


def too_big(n: int, limit: int) -> str:
    return f"request body of {n} bytes is over this server's limit of {limit} (--max-body-mb)"


def read_chunked(rfile: Any, limit: int) -> bytes:
    """A ``Transfer-Encoding: chunked`` body (RFC 9112 7.1): size lines in hex (extensions after
    ``;`` ignored), each chunk followed by CRLF, a zero-size chunk, then trailer lines up to an
    empty one. Refuses a body over ``limit`` bytes (413) as soon as its size lines say so, and a
    malformed or cut one (400)."""
    parts, total = [], 0
    while True:
        line = rfile.readline(1026)
        if not line.endswith(b"\n"):
            raise Refused(400, "chunked body ended or its size line is too long")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise Refused(400, f"bad chunk size {size_text[:20]!r} in a chunked body") from None
        if size < 0:
            raise Refused(400, f"bad chunk size {size_text[:20]!r} in a chunked body")
        if size == 0:
            break
        total += size
        if total > limit:
            raise Refused(413, too_big(total, limit))
        data = rfile.read(size)
        if len(data) != size or rfile.readline(3) not in (b"\r\n", b"\n"):
            raise Refused(400, f"chunked body: a chunk of {size} bytes is cut short or not "
                               f"followed by CRLF")
        parts.append(data)
    for _ in range(100):        # trailers, up to the empty line
        line = rfile.readline(8192)
        if line in (b"\r\n", b"\n"):
            return b"".join(parts)
        if not line.endswith(b"\n"):
            break
    raise Refused(400, "chunked body has no end (its trailer section is not closed)")
