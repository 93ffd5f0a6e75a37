"""`disk_load.load_one` and an engine whose ``update_weights_from_disk`` takes ``**kwargs`` (a
user's proxy that logs or times the call and passes it on, as several tests' wrappers do).

The keywords were sent only where the signature names them, so such a proxy passed on none:
SGLang behind it got ``load_format=None``, which it replaces with its launch ``--load-format``
(``dummy``, verl's default for rollout servers: "Failed to get model loader"), and under
``pause_mode="in_place"`` no ``flush_cache=False`` (SGLang flushed with requests held: the load
failed, its weights loaded). A ``**kwargs`` method now gets them all.
"""

from __future__ import annotations


class _Inner:
    """SGLangEngine's signature; records what it was given."""

    def __init__(self):
        self.calls = []

    def update_weights_from_disk(self, model_path, load_format=None, *, flush_cache=True,
                                 abort_all_requests=False, weight_version=None):
        self.calls.append(dict(path=model_path, load_format=load_format, flush_cache=flush_cache,
                               weight_version=weight_version))


class _Proxy:
    def __init__(self, inner):
        self.inner = inner

    def update_weights_from_disk(self, path, **kw):
        return self.inner.update_weights_from_disk(path, **kw)


def test_a_kwargs_proxy_passes_on_load_format_flush_and_version():
    from fsdp_sync.transport.disk_load import load_one

    inner = _Inner()
    load_one(_Proxy(inner), "/ck/step_3", "v3", flush=False, load_format="auto")
    load_one(_Proxy(inner), "/ck/step_4", None, flush=True, load_format="sharded_state")
    load_one(inner, "/ck/step_5", "v5", flush=False, load_format="auto")     # named: as before
    assert inner.calls == [
        dict(path="/ck/step_3", load_format="auto", flush_cache=False, weight_version="v3"),
        dict(path="/ck/step_4", load_format="sharded_state", flush_cache=True, weight_version=None),
        dict(path="/ck/step_5", load_format="auto", flush_cache=False, weight_version="v5")]
