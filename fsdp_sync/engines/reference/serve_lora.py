"""SGLang's LoRA routes on `fsdp-sync serve`, over the reference engine's adapters (`lora_calls`); a
mixin of `serve.EngineServer`:

    POST /load_lora_adapter_from_tensors  {lora_name, config_dict, serialized_named_tensors,
                                           load_format, pinned, added_tokens_config}
    POST /load_lora_adapter               {lora_name, lora_path, pinned}
    POST /unload_lora_adapter             {lora_name}
    POST /fsdp_sync/lora_checksums        {lora_name} -> {"checksums": {name: digest}, "dtype"}

``serialized_named_tensors`` is SGLang's wire (what verl's ``load_lora_adapter_from_tensor``
sends): one base64 payload per TP rank, each a dict (or list of pairs) of the adapter's full
tensors in peft's names, opened with `weights.handles.open_payload` (shared memory by file name;
nothing but tensors and builtins unpickles). Every payload is opened, each holding a reference its
sender counted on, and the engine loads rank 0's tensors (the engine shards them itself).
``/load_lora_adapter`` reads a peft directory only inside ``--allowed-disk-dir`` (as disk updates).
A load or unload runs under the update lock, like a weight update, and answers SGLang's
``{"success", "error_message", "loaded_adapters"}`` (with this server's ``message`` beside them):
400 with the engine's refusal (an adapter the base cannot take, a name already loaded, one not
loaded), nothing changed. ``/fsdp_sync/lora_checksums`` (fsdp_sync's
own, SGLang has none) answers a digest of each adapter tensor as the engine holds it
(`verify.tensor_digest`, names without ``base_model.model.``, in the engine's dtype): what a
client's verify compares with what it sent.

Not here: the engine's side (`lora_calls`, `lora`), ``lora_path`` in ``/generate``
(`generate_request`), the adapter list in ``/v1/models`` (`serve`).
"""

from __future__ import annotations

from typing import Any

from .http_fields import Refused, body_field, check_disk_path, error_text, opened_payloads, unopened

__all__ = ["LoRARoutes", "lora_source"]


def lora_source(adapter: Any) -> str:
    """Where SGLang says an adapter came from: its directory, ``"__tensor__"`` for tensors."""
    path = adapter.get("path") if isinstance(adapter, dict) else None
    return str(path) if path else "__tensor__"


class LoRARoutes:
    """`EngineServer`'s LoRA routes (it provides ``engine``, ``_method``, ``_locked`` and
    ``allowed_disk_dirs``)."""

    def lora_routes(self) -> dict:
        return {"/load_lora_adapter_from_tensors": self._load_lora_from_tensors,
                "/load_lora_adapter": self._load_lora_from_disk,
                "/unload_lora_adapter": self._unload_lora,
                "/fsdp_sync/lora_checksums": self._lora_checksums}

    def lora_cards(self, parent: str, created: int) -> list[dict]:
        """``/v1/models`` cards of the loaded adapters: SGLang 0.5.23 lists each under its name,
        its ``root`` the path it was loaded from (``"__tensor__"`` for tensors, as in
        ``loaded_adapters``), its ``parent`` the served model."""
        loaded = getattr(self.engine, "lora_adapters", None)
        if not isinstance(loaded, dict):
            return []
        return [{"id": name, "object": "model", "created": created, "owned_by": "sglang",
                 "root": lora_source(loaded[name]), "parent": parent, "max_model_len": None}
                for name in sorted(loaded)]

    @staticmethod
    def _lora_name(body: dict) -> str:
        name = body_field(body, "lora_name", str)
        if not name:
            raise Refused(400, "field 'lora_name' must be a non-empty string")
        return name

    def _lora_call(self, what: str, fn: Any) -> tuple[int, Any]:
        """Run a load / unload under the update lock; the answer is SGLang's ``LoRAUpdateOutput``
        (``success``, ``error_message``: "" on success, ``loaded_adapters``: name -> the path
        it was loaded from, ``"__tensor__"`` for tensors, as SGLang names them) with the
        ``message`` this server's other routes answer."""
        def call() -> tuple[bool, str]:
            try:
                out = fn()
            except (ValueError, KeyError) as exc:   # the engine's refusal: nothing changed
                text = error_text(exc)
                return False, text if text.startswith(what) else f"{what}: {text}"
            return True, str((out or {}).get("message", f"{what}: ok"))

        status, answer = self._locked(what, call)
        if isinstance(answer, dict):
            answer["error_message"] = "" if answer.get("success") else str(answer.get("message", ""))
            loaded = getattr(self.engine, "lora_adapters", None) or {}
            answer["loaded_adapters"] = {n: lora_source(a) for n, a in sorted(loaded.items())}
        return status, answer

    def _load_lora_from_tensors(self, body: dict) -> tuple[int, Any]:
        try:       # every field before any payload is opened: a refusal says so (the sender frees them)
            load = self._method("load_lora_adapter_from_tensors")
            name = self._lora_name(body)
            config = body_field(body, "config_dict", dict)
            payloads = body_field(body, "serialized_named_tensors", list)
            load_format = body_field(body, "load_format", (str, type(None)), None)
            body_field(body, "pinned", bool, False)
            if body.get("added_tokens_config") is not None:
                raise Refused(400, "field 'added_tokens_config': adapters with added tokens are not served")
            tp = int(getattr(self.engine, "tp_size", 1))
            if len(payloads) != tp or not all(isinstance(p, str) for p in payloads):
                raise Refused(400, f"serialized_named_tensors must be {tp} base64 strings (one per TP "
                                   f"rank), got {len(payloads)} item(s)")
        except Refused as exc:
            raise unopened(exc) from None
        with opened_payloads(payloads, "serialized_named_tensors[{i}]") as values:
            value = values[0]
            named = list(value.items()) if isinstance(value, dict) else value
            if not isinstance(named, list) or not all(
                    isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str) for x in named):
                raise Refused(400, "serialized_named_tensors[0] is not a dict (or list of pairs) of "
                                   "name -> tensor")
            return self._lora_call(f"load_lora_adapter_from_tensors({name!r})",
                                   lambda: load(name, named, config, load_format=load_format))

    def _load_lora_from_disk(self, body: dict) -> tuple[int, Any]:
        load = self._method("load_lora_adapter")
        name = self._lora_name(body)
        path = check_disk_path(body_field(body, "lora_path", str), self.allowed_disk_dirs,
                               field="lora_path", what="load_lora_adapter")
        body_field(body, "pinned", bool, False)
        return self._lora_call(f"load_lora_adapter({name!r})", lambda: load(name, str(path)))

    def _unload_lora(self, body: dict) -> tuple[int, Any]:
        unload = self._method("unload_lora_adapter")
        name = self._lora_name(body)
        return self._lora_call(f"unload_lora_adapter({name!r})", lambda: unload(name))

    def _lora_checksums(self, body: dict) -> tuple[int, Any]:
        from ...verify import tensor_digest

        read = self._method("lora_tensors")
        name = self._lora_name(body)
        loaded = getattr(self.engine, "lora_adapters", {})
        if name not in loaded:
            raise Refused(400, f"no LoRA adapter {name!r} is loaded (loaded: {sorted(loaded)})")
        tensors = read(name)
        dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
        return 200, {"checksums": {n: tensor_digest(n, t) for n, t in tensors.items()},
                     "dtype": dtypes.pop() if len(dtypes) == 1 else sorted(dtypes)}
