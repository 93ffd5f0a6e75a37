"""SGLang's weight-update session through `SGLangEngine`: ``begin_weight_update`` …
``end_weight_update`` (0.5.21+; detected once, skipped on older servers). A mixin of
`adapter.SGLangEngine` (it provides ``_http``, ``_local``, ``_check_open``, ``where``, ``tp_size``,
``track_memory``, ``allocator``,
``_version``, ``session_api``, ``server_info``, ``update_weight_version`` and, from `lora`,
``follow_lora_args``).

`stages_disk_loads`: whether a disk load inside a session waits for its commit (``fsdp-sync
serve``) or is applied at once (SGLang, whose session must then not be opened around it).

An abort (``end_weight_update(abort=True)``, what a failed sync sends) is dropped by servers that
can (``fsdp-sync serve``: its answer says ``"aborted": true``; an in-process engine whose
``end_weight_update`` takes ``abort``); SGLang applies each update as it arrives and ignores the
field, so there the session is only closed and a warning says the engine holds what arrived.

Not here: the update calls themselves (`adapter`).
"""

from __future__ import annotations

import logging
from typing import Any

from ..base import EngineStateError, VersionNotNamed
from .client import MissingMethod, NotFound, SGLangError, SGLangHTTPError, check_answer, takes_keyword
from . import versions

__all__ = ["SessionCalls", "SERVE_VERSION"]

SERVE_VERSION = "fsdp_sync-serve"
"""The ``version`` ``fsdp-sync serve`` reports in ``get_server_info`` (`reference.serve`)."""

log = logging.getLogger(__name__)


class SessionCalls:
    """`SGLangEngine`'s session methods (see the module docstring)."""

    _stages_disk: bool | None = None      # `stages_disk_loads`, once asked

    @property
    def stages_disk_loads(self) -> bool:
        """Whether ``update_weights_from_disk`` inside a session is staged until
        `end_weight_update` commits it (the disk method then loads a fleet inside sessions, all or
        none): only ``fsdp-sync serve`` (its ``get_server_info`` says ``version:
        "fsdp_sync-serve"``). SGLang (HTTP or in process) applies a disk load at once and
        post-processes the weights itself; 0.5.23's session does not count it as a load, so its
        ``end_weight_update`` runs ``post_load_weights`` and ``process_weights_after_loading``
        again (twice: layers that repack in place, e.g. online FP8, serve scrambled weights,
        without an error). A server whose info cannot be read counts as SGLang this time, and is
        asked again next time; an answer is kept."""
        if self._stages_disk is None:
            info = None
            if self._http:
                try:
                    info = self.server_info()
                except Exception:  # noqa: BLE001 - unknown: as SGLang, which must not be bracketed
                    return False
            self._stages_disk = isinstance(info, dict) and info.get("version") == SERVE_VERSION
        return self._stages_disk

    def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session (0.5.21+); skipped on engines without one. Over
        HTTP the server's TP size is asked first, every sync (`check_tp_size`)."""
        self._check_open("begin_weight_update")
        self.check_tp_size()
        self._session_call("begin_weight_update")

    def check_tp_size(self) -> None:
        """Refuse, before anything is sent, a server whose TP size is not ``tp_size`` any more (or
        that reports another SGLang release than the one this wrapper read, or that runs its memory
        saver with the weights released, as far as ``track_memory`` knows, or whose LoRA launch
        arguments changed so that they refuse the adapter last checked against them:
        `lora.LoRAClient.follow_lora_args`, which keeps them for the checks that follow).

        ``tp_size`` is read once, when the `SGLangEngine` is made (or given), and the trainer's
        mesh and the manager's first-sync check are built on it; a server restarted at the same URL
        with another ``--tp-size`` would otherwise get one payload per old TP rank: SGLang's TP
        rank i opens ``payloads[i]``, so a larger TP fails inside its workers (an IndexError that
        ends the server) and a smaller one loads old-TP shards. Over HTTP only (an in-process
        engine cannot change); a server without the route (404), or whose answer has no
        ``tp_size``, is not checked."""
        if not self._http:
            return
        try:    # one attempt: a server that cannot answer fails the sync now, as its begin would
            info = self.server_info(retries=0)
        except SGLangError as e:
            if e.status != 404:
                raise
            return
        release, made = versions.reported(info), self._version
        if isinstance(release, str) and isinstance(made, str) and release != made:
            # what this wrapper learned of the release (its session calls, where it keeps
            # LocalSerializedTensor, the checker's fields) would be sent to another one
            raise SGLangError(f"SGLang{self.where} now reports release {release}, but this "
                              f"SGLangEngine was made against {made} (the server was restarted with "
                              f"another release?): nothing was sent. Make a new SGLangEngine for it",
                              call="begin_weight_update")
        if (self.track_memory and info.get("enable_memory_saver") is True
                and "weights" not in self.allocator.held):
            raise SGLangError(f"SGLang{self.where} released its weights' GPU memory "
                              f"(release_memory_occupation with 'weights', started with "
                              f"--enable-memory-saver) and has not taken it back: an update would "
                              f"write into memory SGLang paused (lost, or a CUDA error in its "
                              f"workers); nothing was sent. Call resume_memory_occupation(['weights']) "
                              f"first (the manager's `with` does)", call="begin_weight_update")
        now = info.get("tp_size")
        if isinstance(now, int) and not isinstance(now, bool) and now != self.tp_size:
            raise SGLangError(f"SGLang{self.where} now runs tp_size={now}, but this SGLangEngine was "
                              f"made for tp_size={self.tp_size} (the server was restarted with another "
                              f"--tp-size?) and the trainer's mesh sends one payload per TP rank of "
                              f"that: nothing was sent. Restart the server with --tp-size {self.tp_size}, "
                              f"or make a new SGLangEngine and a mesh with infer_tp={now}",
                              call="begin_weight_update")
        why = self.follow_lora_args(info)        # its LoRA limits, from this same answer
        if why is not None:
            raise SGLangError(f"{why}; nothing was sent", call="begin_weight_update")

    def end_weight_update(self, weight_version: str | None = None, *, abort: bool = False) -> bool | None:
        """Close SGLang's weight-update session; skipped on engines without one.

        ``abort=True`` (after a failed sync: what `fleet.end_all` and the transports send) asks
        the server to drop the session's updates. ``fsdp-sync serve`` does, and says so
        (``"aborted": true``); SGLang applies each update as it arrives and ignores the field, so
        the session is only closed and the engine holds what arrived before the failure: that is
        logged as a warning (sync again before generating), not hidden, and False returned.

        ``weight_version``: the name of the weights just committed, sent in the body.
        ``fsdp-sync serve`` takes it with the commit (no step runs between); a server whose answer
        does not say it took it (SGLang 0.5.23 has no such field) gets `update_weight_version`
        right after, which a request step may come between. In process it is passed to an
        ``end_weight_update`` that takes it, else set with the engine's ``update_weight_version``."""
        if weight_version is not None and not isinstance(weight_version, str):
            raise ValueError(f"end_weight_update: weight_version must be a string or None, got "
                             f"{weight_version!r}")
        if abort:
            if weight_version is not None:
                raise ValueError("end_weight_update: an abort commits no weights; pass "
                                 "weight_version or abort=True, not both")
            return self._abort_update()
        local_kw: dict[str, Any] = {}
        if weight_version is not None and self._local:
            if takes_keyword(self._local.engine, "end_weight_update", "weight_version"):
                local_kw = {"weight_version": weight_version}
            elif not self._local.has("update_weight_version"):
                raise SGLangError(f"this in-process engine ({type(self._local.engine).__name__}) can "
                                  f"take no weight_version (no end_weight_update(weight_version=) "
                                  f"nor update_weight_version); nothing was committed",
                                  call="end_weight_update")
        body = {} if weight_version is None else {"weight_version": weight_version}
        answer = self._session_call("end_weight_update", body, local_kw)
        if weight_version is not None and not local_kw and not (
                isinstance(answer, dict) and answer.get("weight_version") == weight_version):
            try:
                self.update_weight_version(weight_version, abort_all_requests=False)
            except Exception as exc:  # noqa: BLE001 - committed: only the name is missing
                raise VersionNotNamed(f"its new weights are committed, but naming them "
                                      f"{weight_version!r} failed ({type(exc).__name__}: {exc})") from exc

    def _abort_update(self) -> bool:
        """`end_weight_update(abort=True)`: dropped where the engine can, else closed and said so."""
        local_kw = ({"abort": True} if self._local and takes_keyword(self._local.engine, "end_weight_update", "abort")
                    else {})
        answer = self._session_call("end_weight_update", {"abort": True}, local_kw)
        if local_kw:
            return answer is not False
        if isinstance(answer, dict) and answer.get("aborted") is True:
            return True
        if isinstance(answer, dict) and answer.get("aborted") is False:   # a server that says why
            log.warning("fsdp_sync: the engine%s could not drop the failed update: %s", self.where,
                        answer.get("message"))
            return False
        log.warning("fsdp_sync: SGLang%s cannot drop a failed update (it applies each bucket as it "
                    "arrives): the engine now holds the weights sent before the failure; sync "
                    "again before generating", self.where)
        return False

    def _session_call(self, name: str, body: dict | None = None,
                      local_kw: dict | None = None) -> Any:
        self._check_open(name)
        if self.session_api is None and isinstance(self._version, str) \
                and not versions.features(self._version).weight_update_session:
            self.session_api = False     # a release known to have none (0.5.12, 0.5.20): no probe
        if self.session_api is False:
            return None
        try:
            if self._http:
                answer = self._http.json("POST", f"/{name}", body or {}, error=SGLangHTTPError)
            else:
                answer = self._local.call(name, **(local_kw or {}))
        except (MissingMethod, NotFound) as e:
            if self.session_api is None:      # detected once: an older SGLang
                self.session_api = False
                return None
            err = e.error if isinstance(e, NotFound) else None
            raise SGLangError(f"{name} disappeared{self.where} after it had answered before"
                              + (f": {err}" if err else ""), call=name) from None
        except SGLangHTTPError as e:
            # the route exists only where its handler answered (SGLang's 400 refusal, a 500 from
            # it); no answer, or a proxy's 502-504, leaves it unknown, so an older server's 404
            # next time is still read as "no session API", not as a route that disappeared
            if e.status in (400, 500):
                self.session_api = True
            if e.status == 400:   # SGLang's refusal: {"success": false, "message": ...}
                raise EngineStateError(str(e)) from e
            raise
        self.session_api = True
        check_answer(name, answer, error=_state_error, where=self.where)
        return answer


def _state_error(message: str, **kw: Any) -> EngineStateError:
    return EngineStateError(message)
