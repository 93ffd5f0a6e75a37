"""The weight-update routes of `fsdp-sync serve`, one at a time, each bounded by ``update_wait_s``; a
mixin of `serve.EngineServer`:

    POST /update_weights_from_tensor   {serialized_named_tensors, load_format, flush_cache, selector}
    POST /begin_weight_update {selector}  /end_weight_update {weight_version | abort}
    POST /init_weights_update_group    {master_address, master_port, rank_offset, world_size,
                                        group_name, backend}
    POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, flush_cache,
                                            load_format, selector}
    POST /destroy_weights_update_group {group_name}
    POST /update_weights_from_disk     {model_path, load_format}
    POST /release_memory_occupation  /resume_memory_occupation  {tags}

Each runs holding the server's update lock (`_locked`), so two never interleave. Its wait is
bounded: a call that cannot start within ``update_wait_s`` (another update holds the lock, or the
engine is busy: running requests, a group being joined) answers 503 and is never applied later
(the engine's ``wait_limit``). An answer is ``{"success": bool, "message": str}``, 200 or 400 on
the engine's refusal, as SGLang's.

SGLang's ``selector`` (0.5.21+, on the tensor, distributed and ``begin_weight_update`` bodies:
which model runners the call loads, ``"target"``, ``"draft"`` or ``"all"``, default ``"all"``):
this server has one runner, the target, so ``"target"`` and ``"all"`` load it, as SGLang's do
without a draft model; ``"draft"`` is refused (400 naming the field, nothing loaded), where SGLang
without a draft model loads nothing and answers success; any other value is refused too (400,
as SGLang 0.5.23's request validation answers it: its handler turns FastAPI's 422 into 400).

Stricter than SGLang, so a served engine never says success for a wrong model:
``init_weights_update_group`` checks every field before any worker tries to join (a backend the
engine cannot join, ranks that do not fit ``world_size``, a bad port or address: 400 naming the
field); ``update_weights_from_disk`` refuses a checkpoint that lacks any tensor the engine holds or
whose ``config.json`` describes another model (400, old weights kept) and reports the number of
tensors loaded (``tensors_loaded``).

Not here: the server, its limits and how an error becomes a status (`serve`, `http_fields`), the
engine's side of each call (`engine`, `group_calls`).
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Callable

from .http_fields import (Refused, accepted_kwargs, body_field, check_disk_path, opened_payloads,
                          str_list_field, unopened)

__all__ = ["UpdateRoutes", "check_selector", "SELECTORS"]

SELECTORS = ("target", "draft", "all")
"""SGLang 0.5.23's ``selector`` values (``io_struct``: ``Literal["target", "draft", "all"]``)."""


def check_selector(body: dict, what: str) -> None:
    """The body's SGLang ``selector`` (module docstring): ``"all"`` (missing) or ``"target"``
    pass; ``"draft"`` and anything else are refused, 400 naming the field."""
    selector = body.get("selector", "all")
    if selector in ("all", "target") and isinstance(selector, str):
        return
    if selector == "draft":
        raise Refused(400, f"{what}: field 'selector' is 'draft', but this server has no draft model "
                           f"(no speculative decoding): nothing would be loaded (SGLang without a draft "
                           f"model loads nothing and answers success); send 'target' or 'all'")
    raise Refused(400, f"{what}: field 'selector' must be one of {', '.join(map(repr, SELECTORS))}, "
                       f"got {selector!r:.60}")


class UpdateRoutes:
    """`EngineServer`'s update routes (it provides ``engine``, ``_method``, ``versioned``,
    ``allowed_disk_dirs``, ``update_wait_s``, ``_update_lock`` and ``weight_version``)."""

    def _locked(self, what: str, fn: Callable[[], Any], payloads: bool = False) -> tuple[int, Any]:
        """``fn()`` holding the update lock; 503 (nothing applied) if it cannot start within
        ``update_wait_s`` (``payloads``: a request whose payloads ``fn`` opens, which says so)."""
        deadline = time.monotonic() + self.update_wait_s
        if not self._update_lock.acquire(timeout=self.update_wait_s):
            busy = Refused(503, f"{what}: another weight update is running; waited "
                                f"{self.update_wait_s:g}s (--update-wait-s), try again")
            raise unopened(busy) if payloads else busy
        try:
            limit = getattr(self.engine, "wait_limit", None)
            # the engine's own waits (running requests, a group being joined) end at the deadline
            # too: past it the call raises, having changed nothing, rather than applying later
            with (limit(max(0.0, deadline - time.monotonic())) if callable(limit)
                  else contextlib.nullcontext()):
                answer = fn()
            self.updates_served += 1
        finally:
            self._update_lock.release()
        if isinstance(answer, tuple) and len(answer) >= 2 and isinstance(answer[0], bool):
            ok, msg = answer[0], str(answer[1])
            return (200 if ok else 400), {"success": ok, "message": msg}
        return 200, {"success": True, "message": f"{what}: ok"}

    def _update(self, method: str, kwargs: dict) -> tuple[int, Any]:
        fn = self._method(method)
        return self._locked(method, lambda: fn(**kwargs))

    def _begin_weight_update(self, body: dict) -> tuple[int, Any]:
        check_selector(body, "begin_weight_update")
        return self._update("begin_weight_update", {})

    def _update_from_tensor(self, body: dict) -> tuple[int, Any]:
        try:
            update, payloads, load_format, flush = self._tensor_fields(body)
        except Refused as exc:      # before any payload was opened: the sender may free them
            raise unopened(exc) from None
        if load_format == "flattened_bucket":
            call = self.versioned(update, {"load_format": load_format, "flush_cache": flush}, body,
                                  args=(payloads,))
            return self._locked("update_weights_from_tensor", call, payloads=True)

        # Each payload opens, in this process, to TP rank i's list of (name, tensor): the server
        # plays SGLang's TP workers here. Every payload is opened (each holds a shared-memory
        # reference the sender counted on its consumer to take), those after one that cannot be
        # opened too (`opened_payloads`).
        def call() -> Any:
            with opened_payloads(payloads, "payload {i}") as lists:
                for i, lst in enumerate(lists):
                    if not isinstance(lst, list) or not all(
                            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
                            for x in lst):
                        raise Refused(400, f"payload {i} is not a list of (name, tensor) pairs")
                names = [n for n, _ in lists[0]]
                for i, lst in enumerate(lists[1:], 1):
                    if [n for n, _ in lst] != names:
                        raise Refused(400, f"payload {i} names other tensors than payload 0")
                if load_format is None:
                    named = list(lists[0])
                else:
                    named = [(n, [lst[j][1] for lst in lists]) for j, n in enumerate(names)]
                return self.versioned(update, {"load_format": load_format, "flush_cache": flush}, body,
                                      args=(named,))()

        return self._locked("update_weights_from_tensor", call, payloads=True)

    def _tensor_fields(self, body: dict) -> tuple[Callable, list, Any, bool]:
        """The engine's update and the request's fields, checked before any payload is opened
        (`Refused`)."""
        check_selector(body, "update_weights_from_tensor")
        update = self._method("update_weights_from_tensor")
        payloads = body_field(body, "serialized_named_tensors", list)
        load_format = body_field(body, "load_format", (str, type(None)), None)
        flush = body_field(body, "flush_cache", bool, True)
        body_field(body, "weight_version", (str, type(None)), None)     # checked before any payload
        body_field(body, "abort_all_requests", bool, False)             # opens
        tp = int(self.engine.tp_size)
        if len(payloads) != tp or not all(isinstance(p, str) for p in payloads):
            raise Refused(400, f"serialized_named_tensors must be {tp} base64 strings (one per TP "
                               f"rank), got {len(payloads)} item(s)")
        if load_format not in (None, "direct", "flattened_bucket"):
            raise Refused(400, f"unknown load_format {load_format!r}; expected null, "
                               f"'flattened_bucket' or 'direct'")
        return update, payloads, load_format, flush

    def _init_group(self, body: dict) -> tuple[int, Any]:
        """Every field checked before any worker tries to join: a bad one would otherwise cost a
        rendezvous timeout (a minute or more) holding the engine."""
        fn = self._method("init_weights_update_group")
        address = body_field(body, "master_address", str)
        port = body_field(body, "master_port", int)
        offset = body_field(body, "rank_offset", int)
        world = body_field(body, "world_size", int)
        group = body_field(body, "group_name", str, "weight_update_group")
        backends = tuple(getattr(self.engine, "update_group_backends", ("nccl", "gloo")))
        # SGLang's default is NCCL: where the engine joins it (CUDA), a body without a backend
        # gets it, as the trainer following SGLang's protocol expects; gloo where it is the only one
        backend = body_field(body, "backend", str, backends[0] if backends else "nccl")
        tp = int(self.engine.tp_size)
        if not 0 < port < 65536:
            raise Refused(400, f"field 'master_port' must be in 1..65535, got {port}")
        if offset < 1:
            raise Refused(400, f"field 'rank_offset' must be >= 1 (rank 0 is the trainer), got {offset}")
        if world < offset + tp:
            raise Refused(400, f"field 'world_size' {world} cannot hold this server's {tp} TP "
                               f"worker(s) as ranks {offset}..{offset + tp - 1} (rank_offset {offset})")
        if not group:
            raise Refused(400, "field 'group_name' must not be empty")
        if backend not in backends:
            device = getattr(self.engine, "device", None)
            raise Refused(400, f"field 'backend' must be one of {list(backends)} for this "
                               f"{f'{device} ' if device else ''}engine, got {backend!r}")
        try:
            socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise Refused(400, f"field 'master_address': cannot resolve {address!r} ({exc})") from None
        kwargs = accepted_kwargs(fn, {"master_address": address, "master_port": port,
                                      "rank_offset": offset, "world_size": world,
                                      "group_name": group, "backend": backend})
        return self._locked("init_weights_update_group", lambda: fn(**kwargs))

    def _destroy_group(self, body: dict) -> tuple[int, Any]:
        fn = self._method("destroy_weights_update_group")
        kwargs = {"group_name": body_field(body, "group_name", str, "weight_update_group")}
        return self._locked("destroy_weights_update_group", lambda: fn(**accepted_kwargs(fn, kwargs)))

    def _update_from_distributed(self, body: dict) -> tuple[int, Any]:
        check_selector(body, "update_weights_from_distributed")
        names = str_list_field(body, "names")
        dtypes = str_list_field(body, "dtypes")
        shapes = body_field(body, "shapes", list)
        if not all(isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                               and d >= 0 for d in s) for s in shapes):
            raise Refused(400, "field 'shapes' must be a list of lists of non-negative ints")
        if not len(names) == len(dtypes) == len(shapes):
            raise Refused(400, f"names, dtypes and shapes differ in length: {len(names)}, "
                               f"{len(dtypes)}, {len(shapes)}")
        kwargs = {"names": names, "dtypes": dtypes, "shapes": shapes,
                  "group_name": body_field(body, "group_name", str, "weight_update_group"),
                  "flush_cache": body_field(body, "flush_cache", bool, True),
                  "load_format": body_field(body, "load_format", (str, type(None)), None)}
        fn = self._method("update_weights_from_distributed")
        return self._locked("update_weights_from_distributed", self.versioned(fn, kwargs, body))

    def _update_from_disk(self, body: dict) -> tuple[int, Any]:
        """A checkpoint must hold every tensor the engine serves (``require_complete``, where the
        engine takes it): SGLang loads the names present, so a partial directory would serve a
        mix of old and new weights and still say success."""
        real = check_disk_path(body.get("model_path"), self.allowed_disk_dirs)
        body_field(body, "flush_cache", bool, True)       # SGLang's field: the engine always flushes
        kwargs = {"model_path": str(real),
                  "load_format": body_field(body, "load_format", (str, type(None)), None),
                  "require_complete": True}
        fn = self._method("update_weights_from_disk")
        call = self.versioned(fn, kwargs, body)
        loaded: list[Any] = []

        def run() -> Any:
            answer = call()
            loaded.append(getattr(self.engine, "disk_tensors_loaded", None))   # still holding the lock
            return answer

        status, out = self._locked("update_weights_from_disk", run)
        n = loaded[0] if loaded else None
        if status == 200 and isinstance(n, int) and not isinstance(n, bool):
            out["message"] = f"Succeeded to update model weights: {n} tensors from {real}"
            out["tensors_loaded"] = n
        out.setdefault("num_paused_requests", 0)
        return status, out

    def _end_weight_update(self, body: dict) -> tuple[int, Any]:
        """Commit the session; with ``weight_version`` the engine takes it in the same step.
        ``{"abort": true}`` (not SGLang's, whose updates apply as they arrive; it ignores the
        field) drops the session's updates instead: the answer says ``"aborted": true``, which
        tells a client this server kept its previous weights (false where the engine could not:
        its update had written over them in place, `ReferenceEngine.end_weight_update`). A commit of a session an earlier
        failure aborted is a 400: nothing was committed."""
        fn = self._method("end_weight_update")
        abort = body_field(body, "abort", bool, False)
        if abort:
            if body.get("weight_version") is not None:
                raise Refused(400, "end_weight_update: weight_version names weights to commit; "
                                   "an abort commits none (send one or the other)")
            if not accepted_kwargs(fn, {"abort": True}):
                raise Refused(400, f"end_weight_update: this engine ({type(self.engine).__name__}) "
                                   f"cannot abort an update; end it without abort")
            dropped = [None]

            def end() -> None:
                dropped[0] = fn(abort=True)
            status, out = self._locked("end_weight_update", end)
            if status == 200 and dropped[0] is False and getattr(self.engine, "transactional_updates",
                                                                 None) is False:
                # (before: said "serves nothing" of an engine that serves its partly new weights)
                out.update(message="end_weight_update: aborted, nothing committed, but this engine "
                                   "applies each update call as it arrives (transactional_updates=False): "
                                   "it holds partly new weights under its old version; push a whole "
                                   "update before generating from it", aborted=False)
            elif status == 200 and dropped[0] is False:   # it wrote over weights it served: not dropped
                out.update(message="end_weight_update: aborted, nothing committed, but the update had "
                                   "written over the weights in place (start-up weights, or tensors "
                                   "pushed again since a release without backup): the engine serves "
                                   "nothing until every tensor is pushed again", aborted=False)
            elif status == 200:
                out.update(message="end_weight_update: aborted, nothing committed", aborted=True)
            return status, out
        status, out = self._locked("end_weight_update", self.versioned(fn, {}, body))
        if status == 200 and body.get("weight_version") is not None:
            out["weight_version"] = self.weight_version     # the client sees it was taken
        return status, out
