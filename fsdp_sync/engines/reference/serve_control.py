"""SGLang's generation-control routes of `fsdp-sync serve`, fsdp_sync's out-of-service route, and the
weight version the server answers with; a mixin of `serve.EngineServer`:

    POST /pause_generation         {"mode": "abort" | "retract" | "in_place"}   (default "abort")
    POST /continue_generation      {}
    POST /update_weight_version    {"new_version": str, "abort_all_requests": bool}  (default true)
    GET|POST /get_weight_version   -> {"weight_version": str}
    POST /fsdp_sync/set_serving    {"serving": bool, "reason": str}   (fsdp_sync's own)

Answers are SGLang 0.5.23's (``{"message": "Generation paused successfully.", "status": "ok"}``,
``{"success": true, "message": ..., "new_version": ...}``); a bad field answers 400 naming it.

Out of service (``set_serving`` false, a fleet's quarantine): ``/health``, ``/health_generate``,
``/ready`` and ``/generate`` answer 503 with ``{"success": false, "message": reason, "serving":
false}``, so a router stops sending traffic here and no answer made with weights the fleet gave up
on is served; every other route (weight updates, reads) works, so the trainer can bring it back.
While generation is paused, ``/ready`` answers 503 (SGLang's ``is_ready``) and
``/health_generate`` answers 200 without generating (its probe would wait for the continue).

The weight version is the engine's (``get_weight_version`` / ``update_weight_version``); for an
engine that keeps none (a stand-in) the server keeps it, set by the same calls. Update routes pass
their body's ``weight_version`` to the engine method when it takes one (`versioned`), else set it
here once the update succeeded; their ``abort_all_requests`` ends the /generate requests in flight
first, as SGLang's does (without it an update waits for them).

Not here: the other routes, the server and its limits (`serve`), the engine side (`scheduler`,
`rollout`).
"""

from __future__ import annotations

from typing import Any, Callable

from .http_fields import Refused, accepted_kwargs, body_field
from .scheduler import PAUSE_MODES

__all__ = ["ControlRoutes"]


def _succeeded(answer: Any) -> bool:
    return not (isinstance(answer, tuple) and len(answer) >= 2 and answer[0] is False)


class ControlRoutes:
    """`EngineServer`'s control routes (it provides ``engine``, ``_method``, ``_live`` and
    ``_live_lock``)."""

    _own_version = "default"

    # ------------------------------------------------------------------ the weight version
    @property
    def weight_version(self) -> str:
        """The engine's weight version (the server's own for an engine that keeps none)."""
        fn = getattr(self.engine, "get_weight_version", None)
        return str(fn()) if callable(fn) else self._own_version

    @weight_version.setter
    def weight_version(self, value: str) -> None:
        fn = getattr(self.engine, "update_weight_version", None)
        if callable(fn):
            fn(value)
        else:
            self._own_version = value

    def versioned(self, fn: Callable, kwargs: dict, body: dict, *, args: tuple = ()) -> Callable[[], Any]:
        """A call of engine method ``fn`` with ``args``, ``kwargs`` and the body's ``weight_version``."""
        version = body_field(body, "weight_version", (str, type(None)), None)
        abort_all = body_field(body, "abort_all_requests", bool, False)
        kw = accepted_kwargs(fn, dict(kwargs, weight_version=version) if version is not None else kwargs)

        def call() -> Any:
            if abort_all:        # SGLang's field: end the requests the update would wait for
                self._abort_all_requests()
            answer = fn(*args, **kw)
            if version is not None and "weight_version" not in kw and _succeeded(answer):
                self.weight_version = version        # an engine that keeps no version
            return answer

        return call

    def _abort_all_requests(self) -> None:
        """End every /generate in flight at its next step (SGLang's ``abort_all_requests``)."""
        with self._live_lock:
            for flag in self._live.values():
                flag.set()

    # ------------------------------------------------------------------ routes
    def control_routes(self) -> tuple[dict, dict]:
        """(GET routes, POST routes) this mixin answers."""
        gets = {"/health": self._health, "/health_generate": self._health_generate,
                "/ready": self._ready, "/get_weight_version": self._get_weight_version}
        posts = {"/pause_generation": self._pause_generation,
                 "/continue_generation": self._continue_generation,
                 "/update_weight_version": self._update_weight_version,
                 "/fsdp_sync/set_serving": self._set_serving}
        return gets, posts

    def serving_refusal(self) -> tuple[int, Any] | None:
        """The 503 answer while the engine is out of service, else None."""
        state = getattr(self.engine, "serving_state", None)
        if not isinstance(state, str):
            return None
        return 503, {"success": False, "message": state, "serving": False, "retryable": True}

    def _paused(self) -> str | None:
        mode = getattr(self.engine, "generation_paused", None)
        return mode if isinstance(mode, str) else None

    def _health(self, body: dict) -> tuple[int, Any]:
        return self.serving_refusal() or (200, "")

    def _ready(self, body: dict) -> tuple[int, Any]:
        refused = self.serving_refusal()
        if refused is not None:
            return refused
        mode = self._paused()
        if mode is not None:
            return 503, {"success": False, "message": f"generation is paused (mode {mode!r}): "
                                                      f"POST /continue_generation", "retryable": True}
        return 200, ""

    def _health_generate(self, body: dict) -> tuple[int, Any]:
        """200 once one token was generated; 503 naming why not (SGLang's unhealthy answer:
        weights or KV cache released, a dead worker), never a 4xx: the probe asked nothing wrong."""
        refused = self.serving_refusal()
        if refused is not None:
            return refused
        if self._paused() is None:
            try:
                self.engine.generate([[0]], max_new_tokens=1)
            except Exception as exc:  # noqa: BLE001 - any failure to generate is unhealthy
                return 503, {"success": False, "message": f"cannot generate: {type(exc).__name__}: "
                                                          f"{exc}", "retryable": True}
        return 200, ""

    def _get_weight_version(self, body: dict) -> tuple[int, Any]:
        return 200, {"weight_version": self.weight_version}

    def _pause_generation(self, body: dict) -> tuple[int, Any]:
        mode = body_field(body, "mode", str, "abort")
        if mode not in PAUSE_MODES:
            raise Refused(400, f"field 'mode' must be one of {', '.join(map(repr, PAUSE_MODES))}, "
                               f"got {mode!r}")
        self._method("pause_generation")(mode=mode)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue_generation(self, body: dict) -> tuple[int, Any]:
        body_field(body, "torch_empty_cache", bool, True)      # SGLang's; nothing to empty here
        self._method("continue_generation")()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _update_weight_version(self, body: dict) -> tuple[int, Any]:
        new = body_field(body, "new_version", str)
        abort_all = body_field(body, "abort_all_requests", bool, True)     # SGLang's default
        fn = getattr(self.engine, "update_weight_version", None)
        if callable(fn):
            fn(new, abort_all_requests=abort_all)
        else:
            if abort_all:
                self._abort_all_requests()
            self._own_version = new
        return 200, {"success": True, "message": f"Weight version updated to {new}", "new_version": new}

    def _set_serving(self, body: dict) -> tuple[int, Any]:
        serving = body_field(body, "serving", bool)
        reason = body_field(body, "reason", str, "")
        self._method("set_serving")(serving, reason=reason)
        state = getattr(self.engine, "serving_state", None)
        return 200, {"success": True, "serving": serving, "serving_state": state,
                     "message": "serving" if serving else f"out of service: {state}"}
