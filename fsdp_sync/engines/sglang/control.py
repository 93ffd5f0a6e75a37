"""SGLang's generation controls through `SGLangEngine`: pause and continue, the weight version, and
``fsdp-sync serve``'s out-of-service switch. A mixin of `adapter.SGLangEngine` (it provides
``_http``, ``_local``, ``_check_open`` and ``where``).

Over HTTP these are SGLang 0.5.23's routes (``/pause_generation``, ``/continue_generation``,
``/update_weight_version``; the version is read from ``/get_weight_version`` where the server has
it, as ``fsdp-sync serve`` does, else from ``/get_model_info``, which is where SGLang 0.5.23 keeps
it). SGLang's in-process ``sglang.Engine`` has none of them; an in-process engine that has them
(`ReferenceEngine`) is called directly, any other raises `SGLangError` saying so.

``set_serving`` and ``serving_state`` are fsdp_sync's: ``fsdp-sync serve`` refuses requests while
out of service (``POST /fsdp_sync/set_serving``; ``/health`` then answers 503 with the reason). A
real SGLang server has no such switch: a router's ``DELETE /workers/{id}`` takes it out of rotation.

Not here: the weight-update calls (`adapter`), HTTP itself (`client`).
"""

from __future__ import annotations

from typing import Any

from .client import MissingMethod, NotFound, SGLangError, SGLangHTTPError, check_answer, json_or_text

__all__ = ["GenerationControl", "PAUSE_MODES"]

PAUSE_MODES = ("abort", "retract", "in_place")


class GenerationControl:
    """`SGLangEngine`'s generation-control methods (see the module docstring)."""

    def _local_control(self, name: str, **kwargs: Any) -> Any:
        try:
            return self._local.call(name, **kwargs)
        except MissingMethod:
            raise SGLangError(f"this in-process engine ({type(self._local.engine).__name__}) has no "
                              f"{name}; SGLang 0.5.23 serves it over HTTP only (use "
                              f"SGLangEngine(base_url=...))", call=name) from None

    def _post(self, name: str, path: str, body: dict) -> Any:
        try:
            return self._http.json("POST", path, body)
        except NotFound as e:
            raise SGLangError(f"this server{self.where} has no {path}: {e.error}", call=name,
                              status=404) from None

    def pause_generation(self, mode: str = "abort") -> None:
        """Pause SGLang's generation: ``"abort"`` (in-flight requests return aborted),
        ``"retract"`` (they are recomputed after `continue_generation`) or ``"in_place"`` (they
        keep their KV cache). New requests wait until `continue_generation`."""
        self._check_open("pause_generation")
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode must be one of "
                             f"{', '.join(map(repr, PAUSE_MODES))}, got {mode!r}")
        if self._local:
            check_answer("pause_generation", self._local_control("pause_generation", mode=mode))
            return
        answer = self._post("pause_generation", "/pause_generation", {"mode": mode})
        _check_status("pause_generation", answer, self.where)

    def continue_generation(self) -> None:
        """Let SGLang generate again after `pause_generation`."""
        self._check_open("continue_generation")
        if self._local:
            check_answer("continue_generation", self._local_control("continue_generation"))
            return
        answer = self._post("continue_generation", "/continue_generation", {})
        _check_status("continue_generation", answer, self.where)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        """Name the loaded weights ``new_version`` (SGLang's ``/update_weight_version``; tokens
        made from now on carry it). ``abort_all_requests``: end the requests in flight first."""
        self._check_open("update_weight_version")
        if not isinstance(new_version, str):
            raise ValueError(f"update_weight_version: new_version must be a string, got {new_version!r}")
        if self._local:
            answer = self._local_control("update_weight_version", new_version=new_version,
                                         abort_all_requests=bool(abort_all_requests))
        else:
            answer = self._post("update_weight_version", "/update_weight_version",
                                {"new_version": new_version,
                                 "abort_all_requests": bool(abort_all_requests)})
        check_answer("update_weight_version", answer, where=self.where)

    def get_weight_version(self, *, retries: int | None = None) -> str:
        """The server's weight version: ``/get_weight_version`` (``fsdp-sync serve``), or
        ``/get_model_info``'s ``weight_version`` where that route is missing (SGLang 0.5.23); in
        process, ``get_model_info``'s (0.5.23) or ``get_server_info``'s (0.5.12).
        ``retries``: over HTTP, instead of the engine's ``max_retries`` (0: one attempt, as the
        fleet probes a replica it has taken out of service)."""
        self._check_open("get_weight_version")
        if self._local:
            if self._local.has("get_weight_version"):
                return str(self._local.call("get_weight_version"))
            # 0.5.23's get_server_info answers the launch record (its weight_version stays the
            # launch value after updates): get_model_info has the live one; 0.5.12 has no
            # get_model_info, and its get_server_info reads the server args updates change
            info = self._local_control("get_model_info" if self._local.has("get_model_info")
                                       else "get_server_info")
            version = info.get("weight_version") if isinstance(info, dict) else None
        else:
            try:
                answer = self._http.json("GET", "/get_weight_version", idempotent=True, retries=retries)
            except NotFound:
                try:
                    answer = self._http.json("GET", "/get_model_info", idempotent=True, retries=retries)
                except NotFound as e:
                    raise e.error from None
            version = answer.get("weight_version") if isinstance(answer, dict) else None
        if not isinstance(version, str):
            raise SGLangError(f"get_weight_version{self.where}: no weight_version in the answer",
                              call="get_weight_version")
        return version

    def set_serving(self, serving: bool, reason: str = "") -> None:
        """Take ``fsdp-sync serve`` out of service (``serving=False``: it answers ``/generate`` and
        ``/health`` with 503 naming ``reason``) or bring it back. A real SGLang server has no such
        switch: this raises `SGLangError` saying to use the router's ``DELETE /workers/{id}``."""
        self._check_open("set_serving")
        if not isinstance(serving, bool) or not isinstance(reason, str):
            raise ValueError(f"set_serving takes (serving: bool, reason: str), got "
                             f"({serving!r}, {reason!r})")
        if self._local:
            if not self._local.has("set_serving"):
                raise SGLangError(f"this in-process engine ({type(self._local.engine).__name__}) "
                                  f"cannot be taken out of service; stop routing requests to it",
                                  call="set_serving")
            self._local.call("set_serving", serving=serving, reason=reason)
            return
        try:
            answer = self._http.json("POST", "/fsdp_sync/set_serving",
                                     {"serving": serving, "reason": reason})
        except NotFound:
            raise SGLangError(f"the server{self.where} is not fsdp-sync serve (it has no "
                              f"/fsdp_sync/set_serving): a real SGLang server cannot refuse "
                              f"requests itself; take it out of rotation with the router's "
                              f"DELETE /workers/{{id}} (the id from GET /workers; POST /workers "
                              f"with {{'url': ...}} brings it back)",
                              call="set_serving", status=404) from None
        check_answer("set_serving", answer, where=self.where)

    @property
    def serving_state(self) -> str | None:
        """None while the server serves; else why not: the message of ``/health``'s 503 (out of
        service, or a dead engine). In process: the engine's own ``serving_state``, if any."""
        self._check_open("serving_state")
        if self._local:
            state = getattr(self._local.engine, "serving_state", None)
            return state if isinstance(state, str) else None
        try:
            self._http.request("GET", "/health")
        except SGLangHTTPError as e:
            if e.status != 503:
                raise
            body = json_or_text(e.body or "")
            if isinstance(body, dict) and isinstance(body.get("message"), str):
                return body["message"]
            return str(body or "unavailable (HTTP 503)")
        except NotFound as e:
            raise e.error from None
        return None


def _check_status(call: str, answer: Any, where: str) -> None:
    """SGLang's pause/continue answer ``{"message": ..., "status": "ok"}``."""
    if not (isinstance(answer, dict) and answer.get("status") == "ok"):
        raise SGLangError(f"{call}{where} answered {str(answer)[:200]!r}, not status ok", call=call)
