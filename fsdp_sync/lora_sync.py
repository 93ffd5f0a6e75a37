"""Adapter-only syncs of a LoRA model (`SyncConfig.lora="adapter"`), as verl's SGLang rollout
serves LoRA: the base weights go once through the configured transport (the export leaves
``lora_`` tensors out and drops peft's ``base_model.model.`` / ``.base_layer`` levels), then every
sync sends only the adapter, through the engine's ``load_lora_adapter_from_tensors`` under
`SyncConfig.lora_name`.

- `active_adapter`: which of the module's adapters is synced: the one the peft model runs
  (``active_adapters``, one; several active at once are refused: their sum is no one adapter the
  engine serves), or the only one it holds. Its tensors alone are exported and its config used.
- `adapter_config`: the adapter's peft config dict (``module.peft_config[active adapter]`` of a
  peft model, or the ``peft_config=`` given to the manager), normalized as verl does for SGLang (enums to
  strings; sets, such as peft's ``target_modules`` / ``exclude_modules``, to sorted lists: SGLang's
  HTTP body is JSON; a missing ``lora_alpha`` is peft's default 8, which SGLang reads by key;
  ``target_modules`` required), checked against the LoRA tensors the module holds (rank from their shapes, targets
  from their names).
- `refusal`, before anything is sent (the base at the first sync included): a config the engines
  would serve differently from the trainer (`config_refusal`: an option SGLang's LoRA does not
  apply, `peft_names.UNSERVED`; a ``rank_pattern`` / ``alpha_pattern`` entry, which it ignores;
  trained biases, a regex, embeddings or lm_head as targets), a tensor that is not lora_A /
  lora_B of a linear module (`peft_names.unserved_tensor`: KaSA's ``lora_diag``, ...), and, at a
  sync that sends the adapter alone, base parameters that still train (``requires_grad``); an
  adapter peft merged into the base weights (``merge_adapter``, `peft_names.merged`: the base
  sent would hold it, and the engine would add it again).
- the full LoRA tensors, gathered by the export (collective) into one flattened bucket kept from
  one sync to the next (`weights.adapter_export`), named as peft saves them
  (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: the adapter's name segment
  dropped), the names SGLang's LoRA loader and the reference engine read.
- `check_engine`, on every engine before any is loaded (and before the base goes): another rank
  or other target modules than the adapter it serves, beyond its ``max_lora_rank`` /
  ``lora_target_modules``, what its own load would refuse (the reference engine's
  ``lora_refusal``), base weights that are not the ones this manager synced (`engine_version`
  changed; in a fleet of several replicas `lora_stage.restarted` takes such a replica out to
  give it the base again before this check), or, for SGLang, target modules its LoRA code cannot stack (`sglang_refusal`).
- `load_all` / `load_adapter`: swap the adapter in (the reference engine stages the new one on
  every worker before dropping the old one, ``replace=True``; SGLang is unloaded, then loaded, as
  verl does); a failure on some replicas follows `SyncConfig.on_replica_failure` (`sync_adapter`:
  the others put back on the previous adapter, `put_back`, or the failing ones quarantined); a
  replica that cannot take updates (`fleet.problem`) is taken out of service in either mode.
- `verify_adapter`: read the adapter back and compare bit for bit (digest for digest where the
  engine reports digests: `check_digests`); at a sync that sends the adapter alone the base too
  (`lora_stage.verify_base`), so a verified sync says the engine serves the trainer's model.

The adapter travels as one flattened bucket per call, one handle per TP rank, the same payload
form as a full sync's buckets: to a reference engine, the trainer's own kept buffer where the ranks
share one host (``load_format="flattened_bucket"``, no copy), else the engine packs the tensors
(`engines.reference.update_items.pack_plain`).

Not here: the manager's stage (`lora_stage`: the base once, the fleet's targets, rejoining
replicas, the version), the base weights' sync (the transports), the engine's side
(`engines.reference.lora`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from .fleet import describe, problem
from .topology import SyncError
from .transport import SyncStats
from .verify import tensor_digest
from .weights import bucket, export, handles
from .weights.adapter_export import AdapterCopy, AdapterExport
from .wire import flattened_bucket
from .weights.peft_names import (adapter_of, config_refusal, merged, pattern_refusal, sglang_refusal,
                                 sglang_targets, trainable_base, unserved_tensor)

log = logging.getLogger("fsdp_sync")

__all__ = ["check_mode", "memory_tags", "sync_adapter", "active_adapter", "adapter_config", "refusal",
           "pattern_refusal", "config_refusal", "check_engine", "engine_version", "sglang_refusal",
           "load_adapter", "verify_adapter", "check_digests", "peft_name", "close", "json_ready"]


def check_mode(module: torch.nn.Module, config: Any) -> None:
    """Refuse a module holding LoRA tensors under ``SyncConfig.lora="off"``: its full sync
    would leave the adapter out (the export never sends ``lora_`` tensors as weights)."""
    if config.lora == "off" and any(export.is_lora(n) for n, _ in module.named_parameters()):
        raise ValueError("the module holds LoRA tensors (peft's lora_A / lora_B) but SyncConfig.lora "
                         "is 'off': a full sync would leave the adapter out; set SyncConfig(lora="
                         "'adapter') to sync the base once and then the adapter only, or merge the "
                         "adapter into the weights and drop it first (peft's merge_and_unload(); "
                         "merge_adapter() keeps the lora_A / lora_B tensors)")


def memory_tags(config: Any, tags: list[str] | None) -> list[str] | None:
    """The engine memory the manager releases / resumes: with ``lora="adapter"`` the KV cache
    only, as verl's SGLang rollout does for LoRA adapters (the base weights are synced once and
    must still be there at the next, adapter-only, sync); ``[]``: nothing."""
    if config.lora != "adapter":
        return tags
    return ["kv_cache"] if tags is None or "kv_cache" in tags else []


def sync_adapter(module: torch.nn.Module, config: Any, engines: list, peft_config: Any,
                 base_versions: dict[int, Any], agree: Callable[..., None],
                 kept: AdapterExport | None = None, *, base_sent: bool = False,
                 names: list[str] | None = None, quarantine: Callable[[int, str], None] | None = None,
                 previous: AdapterCopy | None = None, before_load: Callable[[], None] | None = None,
                 on_loaded: Callable[..., None] | None = None,
                 blame: Callable[[int, str], None] | None = None) -> SyncStats:
    """One adapter sync, on every trainer rank: all gather the adapter; the engine ranks check it
    (`refusal`) and against every engine (`check_engine`) before loading it into any, then load it
    (`load_all`); all ``agree`` after each step, so a refusal or failure on one rank raises the
    same `SyncError` on every rank, naming the replica (``names``: the engines' replica names,
    default `fleet.describe`). A failed load leaves no replica silently on another adapter than
    the others: with ``quarantine`` (``(index, reason)``: the manager's, under
    ``on_replica_failure="quarantine"``) the replicas that failed are taken out of service and the
    others keep the new adapter (all failing: the sync fails); without it (``"abort"``) the
    replicas that took it, on any rank, and those whose failed load dropped their old one, are put
    back on the adapter they served (`put_back`: ``previous``, the copy of the last one loaded, or
    none where they held none), and the error says which could not be. ``blame`` (``(index,
    reason)``, a fleet's, in either mode): a replica whose check or load failed because it cannot
    take updates (`fleet.problem`: dead workers, a server that does not answer) is taken out of
    service through it, as a full sync's failure takes it out, and not reported as a refusal;
    under ``quarantine`` the others go on, else the sync fails saying so. ``before_load`` /
    ``on_loaded``: called on every rank once every check passed, and once the engines hold the
    adapter, before the verify (the manager pauses and resumes generation there, and names the
    version); ``on_loaded(serving, tensors=, cfg=, metas=, shared=)``: the indices that hold it
    and the adapter as loaded. Then, with `SyncConfig.verify`, each engine's adapter is read back
    and compared bit for bit. ``kept``: the export kept from the previous sync
    (`weights.adapter_export`; None: a fresh one, freed after). ``base_sent``: this sync sent the
    base just before (False: the adapter goes alone, so base parameters that still train are
    refused). Returns the sync's figures (seconds: gather + load, without the verify)."""
    name = config.lora_name
    names = list(names) if names is not None else [describe(e, i) for i, e in enumerate(engines)]
    t0 = time.perf_counter()
    err, tensors, cfg, adapter, metas = None, {}, {}, None, []
    export_ = kept if kept is not None else AdapterExport(peft_name)
    try:
        try:
            why = None
            try:
                adapter = active_adapter(module)
                why = refusal(module, peft_config, base_sent=base_sent, adapter=adapter)
            except Exception as exc:  # noqa: BLE001 - said below, after the collective export
                why = f"{type(exc).__name__}: {exc}"
            try:
                tensors = export_.tensors(module, config.dtype, adapter)   # collective: even after a refusal
            except Exception:
                if why is None:
                    raise
            if why is None:
                metas = [bucket.TensorMeta(e.name, e.dtype, e.shape) for e in export_.bucket.entries] \
                    if export_.bucket is not None else []
                cfg = adapter_config(module, peft_config, adapter, metas=metas)
            err = why
        except Exception as exc:  # noqa: BLE001 - reported to every rank just below
            err = f"{type(exc).__name__}: {exc}"
        agree(err, what="adapter sync")
        err, out = _check_all(engines, names, cfg, name, base_versions, metas, quarantine, blame)
        agree(err, what=f"adapter sync of {name!r}")
        live = [i for i in range(len(engines)) if i not in out]     # not those found dead just now
        if before_load is not None:
            before_load()
        lost = _load([engines[i] for i in live], [names[i] for i in live], name, tensors, cfg,
                     export_.shared(), quarantine and (lambda j, why: quarantine(live[j], why)), previous,
                     agree, blame and (lambda j, why: blame(live[j], why)))
        out.update({live[j]: why for j, why in lost.items()})
        serving = [i for i in range(len(engines)) if i not in out]
        stats = SyncStats(seconds=time.perf_counter() - t0,
                          bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                          tensors=len(tensors), buckets=1, engine_calls=len(live),
                          extra={"lora": name, "r": cfg.get("r"), "adapter": adapter})
        if out:
            stats.extra["replicas_out"] = [f"{names[i]}: {why}" for i, why in sorted(out.items())]
        if previous is not None:
            previous.keep(tensors, cfg)
        if on_loaded is not None:
            on_loaded(serving, tensors=tensors, cfg=cfg, metas=metas, shared=export_.shared())
        if config.verify != "off":
            err = None
            for i in serving:         # not those taken out of service just now
                if err is None and (why := verify_adapter(engines[i], name, tensors)) is not None:
                    err = f"{names[i]}: {why}" if len(engines) > 1 else why
            stats.extra["verify_tensors"] = len(tensors)
            agree(err, what=f"verify={config.verify!r} of adapter {name!r}")
    finally:
        del tensors
        if kept is None:
            export_.close()
    return stats


def _check_all(engines: list, names: list[str], cfg: dict, name: str, base_versions: dict[int, Any],
               metas: list, quarantine: Callable[[int, str], None] | None,
               blame: Callable[[int, str], None] | None) -> tuple[str | None, dict[int, str]]:
    """`check_engine` on every engine before any is loaded: ``(error or None, {index: why}: the
    engines that cannot take updates, taken out through ``blame``)``. A check that raises on an
    engine that cannot take updates (`fleet.problem`) is no refusal: that engine is taken out;
    under ``quarantine`` the sync goes on without it (not with none left), else it fails."""
    err, out = None, {}
    for i, engine in enumerate(engines):
        try:
            why = check_engine(engine, cfg, name, base_versions.get(id(engine)), metas)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
            why = f"{type(exc).__name__}: {exc}"
            dead = problem(engine) if blame is not None else None
            if dead is not None:
                blame(i, dead)
                out[i] = dead
                if quarantine is not None and len(out) < len(engines):
                    continue
                return (f"{names[i]} cannot take updates ({why}): quarantined, the next sync goes "
                        f"to the others; nothing was loaded: every engine keeps its adapter"), out
        if why is not None:
            return f"{names[i]}: {why}; nothing was loaded: every engine keeps its adapter", out
    if out:
        log.warning("fsdp_sync: adapter %r: quarantined before the load: %s", name,
                    "; ".join(f"{names[i]}: {why}" for i, why in out.items()))
    return err, out


def _load(engines: list, names: list[str], name: str, tensors: dict, cfg: dict, shared: Any,
          quarantine: Callable[[int, str], None] | None, previous: AdapterCopy | None,
          agree: Callable[..., None], blame: Callable[[int, str], None] | None = None) -> dict[int, str]:
    """`sync_adapter`'s load into every engine and what a failure does (see there), agreed on
    every rank; returns the engines taken out of service (index -> why)."""
    loaded, failed, had = load_all(engines, name, tensors, cfg, shared, keep_going=quarantine is not None)
    err, out = None, {}
    if failed and quarantine is not None and loaded:      # the others serve it; these are taken out
        for i, why in sorted(failed.items()):
            quarantine(i, f"failed to load adapter {name!r}: {why}")
            out[i] = why
        log.warning("fsdp_sync: adapter %r loaded on %d replicas; quarantined: %s", name, len(loaded),
                    "; ".join(f"{names[i]}: {why}" for i, why in out.items()))
    elif failed:
        first = min(failed)
        others = [names[i] for i in sorted(failed) if i != first]
        err = (f"{names[first]} failed to load adapter {name!r}: {failed[first]}"
               + (f" ({', '.join(others)} failed too)" if others else ""))
        dead = {i: why for i in sorted(failed) if blame is not None and (why := problem(engines[i]))}
        for i, why in dead.items():            # out of service, as a full sync's failure takes it
            blame(i, why)
            out[i] = why
        back = loaded + [i for i in sorted(failed) if not transactional(engines[i]) and i not in dead]
        err += _put_all_back(engines, names, back, loaded, name, previous, had) or (
            "; every replica is back on the adapter it served before" if back else
            "; no replica took it: each keeps the adapter it served")
        if dead:
            err += (f"; quarantined (cannot take updates; the next sync goes to the others): "
                    f"{', '.join(names[i] for i in dead)}")
    try:
        agree(err, what=f"adapter sync of {name!r}")
    except SyncError as exc:      # another rank's engine failed: this rank's go back too
        note = None if failed else _put_all_back(engines, names, loaded, loaded, name, previous, had)
        try:
            agree(note and note.removeprefix("; "), what=f"putting adapter {name!r}'s previous version back")
        except SyncError as back:
            exc.add_note(str(back))
        raise
    return out


def _put_all_back(engines: list, names: list[str], back: list[int], loaded: list[int], name: str,
                  previous: AdapterCopy | None, had: list) -> str | None:
    """`put_back` on the engines ``back``: None once every one is back, else which
    could not be and what each serves now (``loaded``: those that took the new adapter)."""
    stuck = []
    for i in back:
        why = put_back(engines[i], name, previous, had[i] if i < len(had) else None)
        if why is not None:
            now = "the new adapter" if i in loaded else f"no adapter {name!r}"
            stuck.append(f"{names[i]} {why} and serves {now}")
    if not stuck:
        return None
    return f"; the replicas do not all serve the same adapter now: {'; '.join(stuck)}"


def close(manager: Any) -> None:
    """Free the adapter's export ``manager`` kept between syncs, and its copy of the last adapter
    (`sync_weights`; the manager's ``close``)."""
    manager.lora_prev = None
    kept, manager.lora_export = getattr(manager, "lora_export", None), None
    if kept is not None:
        kept.close()


def peft_name(name: str) -> str:
    """A LoRA tensor's export name as peft saves it: ``base_model.model.`` first, no adapter
    segment (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.startswith("lora_"):    # a ParameterDict's trailing ``.<adapter>`` goes too
            if adapter_of(name) is not None:
                parts = parts[:i + 1] + parts[i + 2:]
            break
    return "base_model.model." + ".".join(parts)


def active_adapter(module: torch.nn.Module) -> str | None:
    """The adapter a sync serves: the peft model's active one (``active_adapters``, else
    ``active_adapter``), or, for a module that names none, the only adapter its LoRA tensors hold
    (`peft_names.adapter_of`; None where their names carry no adapter level). Raises ValueError
    for several active adapters (peft sums them: no one adapter the engine could serve under
    `SyncConfig.lora_name`), an active adapter without LoRA tensors, or several held and none
    named active. No collective: the same answer on every rank."""
    held = sorted({a for m in export.param_metas(module, lora=True) if (a := adapter_of(m.name))})
    active = getattr(module, "active_adapters", None)
    if active is None:
        active = getattr(module, "active_adapter", None)
    if callable(active):        # transformers' PeftAdapterMixin: methods that raise without adapters
        try:
            active = active()
        except Exception:  # noqa: BLE001 - no adapter loaded through transformers: none active
            active = None
    if isinstance(active, str):
        active = [active]
    if active is None:
        if len(held) > 1:
            raise ValueError(f"the module holds the LoRA tensors of adapters {held} and names none "
                             f"active (no active_adapter): SyncConfig.lora='adapter' serves one "
                             f"adapter; keep one, or use a peft model (peft_model.set_adapter(name))")
        return held[0] if held else None
    active = list(active)
    if len(active) != 1:
        raise ValueError(f"the peft model's active adapters are {active}: it sums their outputs, "
                         f"and the engine serves one adapter under SyncConfig.lora_name; activate "
                         f"one (peft_model.set_adapter(name)), or combine them into one adapter "
                         f"(peft's add_weighted_adapter) and activate that")
    if held and active[0] not in held:
        raise ValueError(f"the peft model's active adapter {active[0]!r} has no LoRA tensors in the "
                         f"module (it holds those of {held})")
    return active[0]


def _given_config(module: torch.nn.Module, given: Any, adapter: str | None = None) -> dict | None:
    """The adapter's config as given (``peft_config=``) or as the peft model holds it under
    ``adapter``'s name (None: `active_adapter`'s, "default" where the tensors name none), a dict."""
    cfg = given
    if cfg is None:
        peft_cfg = getattr(module, "peft_config", None)
        if adapter is None:
            adapter = active_adapter(module)
        adapter = "default" if adapter is None else adapter
        if isinstance(peft_cfg, dict) and adapter in peft_cfg:
            cfg = peft_cfg[adapter]
    if cfg is None:
        return None
    return dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)


def refusal(module: torch.nn.Module, given: Any, *, base_sent: bool,
            adapter: str | None = None) -> str | None:
    """Why this adapter sync must not run (None: it may): the config's `config_refusal`, a LoRA
    tensor of the adapter that no engine serves (`peft_names.unserved_tensor`: not lora_A /
    lora_B, or on embeddings / lm_head), the adapter merged into the base weights
    (`peft_names.merged`), and, at a sync that sends the adapter alone
    (``base_sent`` False), base parameters that still train (`peft_names.trainable_base`). Cheap
    (the config and one walk over ``named_parameters``). ``adapter``: the synced adapter's name
    (None: `active_adapter`)."""
    if adapter is None:
        adapter = active_adapter(module)
    why = config_refusal(_given_config(module, given, adapter))
    if why is None:
        why = unserved_tensor((n for n, _ in module.named_parameters()), adapter)
    if why is None and (into := merged(module.named_modules(), adapter)):
        why = (f"the adapter {adapter or 'default'!r} is merged into the base weights of {into[0]!r}"
               f"{f' and {len(into) - 1} other module(s)' if len(into) > 1 else ''} (peft's "
               f"merge_adapter): the base sent would hold it and the engine would add it again; "
               f"unmerge it before the sync (peft_model.unmerge_adapter()), or merge_and_unload() "
               f"and sync the weights with SyncConfig(lora='off')")
    if why is not None or base_sent:
        return why
    live = trainable_base(module.named_parameters())
    if not live:
        return None
    return (f"SyncConfig.lora='adapter' sends the adapter alone at this sync, but {len(live)} base "
            f"parameter(s) still train (requires_grad=True: {live[:3]}{' ...' if len(live) > 3 else ''}): "
            f"the engine would serve the base as last sent while the trainer's changes; freeze "
            f"them (p.requires_grad_(False), as peft's get_peft_model does), or set "
            f"manager.base_sync_done=False before every sync that follows a change of them (the "
            f"base is sent again), or merge the adapter and sync with SyncConfig(lora='off')")


def json_ready(cfg: dict) -> dict:
    """``cfg`` (a peft config dict) made JSON as SGLang's HTTP body needs it, in place: its enums
    (task_type, peft_type) as their values, its sets (peft holds target_modules / exclude_modules
    as sets; JSON has none, and SGLang's load fails after the old adapter's unload) as sorted
    lists, its tuples as lists."""
    for key in ("task_type", "peft_type"):
        if key in cfg:
            cfg[key] = getattr(cfg[key], "value", cfg[key])
    for key, value in cfg.items():
        if isinstance(value, (set, frozenset)):
            cfg[key] = sorted(value, key=str)
        elif isinstance(value, tuple):
            cfg[key] = list(value)
    return cfg


def adapter_config(module: torch.nn.Module, given: dict | None, adapter: str | None = None, *,
                   metas: list | None = None) -> dict:
    """The config dict of adapter ``adapter`` (None: `active_adapter`; see the module docstring);
    raises ValueError naming what is missing or what the module's LoRA tensors contradict.
    ``metas``: the adapter's LoRA tensors' metas when the caller has them (the export's plan),
    else read from the module (that adapter's only)."""
    if adapter is None:
        adapter = active_adapter(module)
    cfg = _given_config(module, given, "default" if adapter is None else adapter)
    if cfg is None:
        held = getattr(module, "peft_config", None)
        has = f" (module.peft_config holds {sorted(held)}, not {adapter!r})" if isinstance(held, dict) else ""
        raise ValueError(f"SyncConfig.lora='adapter' needs the adapter's config: a peft model "
                         f"(module.peft_config[adapter name]){has} or FSDPShardingManager("
                         f"peft_config={{'r': ..., 'lora_alpha': ..., 'target_modules': [...]}})")
    cfg.setdefault("peft_type", "LORA")
    cfg.setdefault("lora_alpha", 8)      # peft's default, the reference engine's; SGLang reads the key
    if cfg.get("target_modules") is None:     # SGLang's load raises KeyError (after the unload)
        raise ValueError(f"the adapter config {sorted(cfg)} has no target_modules: the engine "
                         f"stacks and serves the adapter by them; give peft_config={{'r': ..., "
                         f"'lora_alpha': ..., 'target_modules': [...]}} (peft's resolved list)")
    json_ready(cfg)
    if metas is None:
        metas = [m for m in export.param_metas(module, lora=True)
                 if adapter is None or adapter_of(m.name) == adapter]
    if not metas:
        raise ValueError("SyncConfig.lora='adapter' but the module holds no LoRA tensors (no "
                         "parameter named like '...q_proj.lora_A.default.weight')")
    ranks = {m.shape[0] for m in metas if ".lora_A." in m.name} | {m.shape[1] for m in metas if ".lora_B." in m.name}
    if ranks != {cfg.get("r")}:
        raise ValueError(f"the adapter config says r={cfg.get('r')!r} but the module's LoRA tensors "
                         f"have rank {sorted(ranks)}")
    return cfg


def engine_version(engine: Any) -> Any:
    """The version of the base weights ``engine`` serves: the reference engine's
    ``weight_version``, else SGLang's ``get_weight_version()`` (an `SGLangEngine` has no such
    attribute; a restarted server answers its launch version); None where it has neither."""
    version = getattr(engine, "weight_version", None)
    if version is not None and not callable(version):
        return version
    ask = getattr(engine, "get_weight_version", None)
    return ask() if callable(ask) else None


def check_engine(engine: Any, cfg: dict, name: str, base_version: Any,
                 metas: list | None = None) -> str | None:
    """Why ``engine`` cannot take this adapter now (None: it can). See the module docstring.
    ``metas``: the adapter's tensors (`bucket.TensorMeta`, export names), checked by an engine
    that can say what its load would refuse without loading (the reference engine's
    ``lora_refusal``: config, rank, names, shapes). ``base_version`` None: not checked (the
    base is about to be sent)."""
    r, targets = cfg.get("r"), cfg.get("target_modules")
    if not callable(getattr(engine, "load_lora_adapter_from_tensors", None)):
        return (f"adapter {name!r}: the engine {type(engine).__name__} has no load_lora_adapter_from_tensors "
                f"(SGLang's LoRA call); SyncConfig.lora='adapter' needs an engine that serves adapters")
    own = getattr(engine, "lora_refusal", None)
    if callable(own):
        why = own(cfg, [(peft_name(m.name), m.dtype, m.shape) for m in metas or ()])
        if why is not None:
            return f"adapter {name!r}: the engine would refuse it: {why}"
    loaded = getattr(engine, "lora_adapters", None)
    held = loaded.get(name) if isinstance(loaded, dict) else None
    if held is not None:
        want = sorted(targets) if isinstance(targets, (list, tuple)) else targets
        then = (f"; to serve this one under {name!r}, unload the engine's first "
                f"(engine.unload_lora_adapter({name!r})), or sync it under another SyncConfig.lora_name")
        if held.get("r") != r:
            return (f"adapter {name!r}: r={r} but the engine serves it with r={held.get('r')} "
                    f"(its LoRA memory is sized for that rank); the engine keeps its adapter" + then)
        got = sorted(held.get("target_modules") or [])
        if isinstance(want, list) and got != want:
            return (f"adapter {name!r}: target_modules {want} but the engine serves it on {got}; "
                    f"the engine keeps its adapter" + then)
    if not isinstance(loaded, dict):      # SGLang (the reference engine serves any subset)
        why = sglang_refusal(targets)
        if why is not None:
            return f"adapter {name!r}: {why}"
    max_r = getattr(engine, "max_lora_rank", None)
    if isinstance(max_r, int) and isinstance(r, int) and r > max_r:
        return f"adapter {name!r}: r={r} exceeds the engine's max_lora_rank {max_r}"
    allowed = getattr(engine, "lora_target_modules", None)
    if allowed is not None and isinstance(targets, (list, tuple)):
        pool = sglang_targets(list(allowed)) or set()      # as SGLang compares them (normalized)
        extra = [] if "all" in pool else [m for m in targets if not sglang_targets([m]) <= pool]
        if extra:
            return (f"adapter {name!r}: target_modules {extra} are not in the engine's "
                    f"lora_target_modules {list(allowed)} (SGLang's --lora-target-modules, compared "
                    f"as SGLang stacks them: q/k/v into qkv_proj, gate/up into gate_up_proj)")
    now = engine_version(engine) if base_version is not None else None
    if base_version is not None and now is not None and now != base_version:
        return (f"adapter {name!r}: the engine's base weights are version {now!r}, not the base "
                f"version {base_version!r} this manager synced; set manager.base_sync_done=False "
                f"to sync the base again")
    return None


def holds(engine: Any, name: str) -> bool | None:
    """Whether ``engine`` serves an adapter ``name`` now (None: it cannot say): the reference
    engine's ``lora_adapters``, else SGLang's ``available_models`` (``/v1/models``)."""
    loaded = getattr(engine, "lora_adapters", None)
    if isinstance(loaded, dict):
        return name in loaded
    models = getattr(engine, "available_models", None)
    if callable(models):
        return any(m.get("id") == name for m in (models() or {}).get("data", []))
    return None


def transactional(engine: Any) -> bool:
    """A failed load leaves ``engine`` on its old adapter (the reference engine's staged
    ``replace=True``); SGLang's was unloaded before."""
    return isinstance(getattr(engine, "lora_adapters", None), dict)


def load_adapter(engine: Any, name: str, tensors: dict[str, torch.Tensor], cfg: dict,
                 shared: tuple[torch.Tensor, Any] | None = None, *, listed: bool | None = None) -> None:
    """Put the adapter into ``engine`` under ``name`` (see the module docstring). ``shared``:
    ``(flat, bucket)``, the same tensors in a shared buffer (`AdapterExport.shared`), handed to a
    reference engine's workers as payloads of that buffer (no copy) where it takes them.
    ``listed``: whether a non-reference engine lists ``name`` already (None: asked, `holds`)."""
    if transactional(engine):             # the reference engine: staged everywhere, then swapped
        if shared is not None and "flattened_bucket" in getattr(engine, "lora_load_formats", ()):
            ps = handles.make_payloads(flattened_bucket(*shared), engine.tp_size)
            try:
                engine.load_lora_adapter_from_tensors(name, list(ps.payloads), cfg,
                                                      load_format="flattened_bucket", replace=True)
            finally:
                ps.release(require_ack=False)
            return
        engine.load_lora_adapter_from_tensors(name, list(tensors.items()), cfg, replace=True)
        return
    if listed if listed is not None else holds(engine, name):
        engine.unload_lora_adapter(name)
    engine.load_lora_adapter_from_tensors(name, list(tensors.items()), cfg)


def load_all(engines: list, name: str, tensors: dict[str, torch.Tensor], cfg: dict, shared: Any, *,
             keep_going: bool) -> tuple[list[int], dict[int, str], list[bool | None]]:
    """`load_adapter` into each engine in turn: ``(indices that took it, {index: error}, per
    engine whether it held ``name`` before)``; ``keep_going``: on to the others after a failure."""
    loaded: list[int] = []
    failed: dict[int, str] = {}
    had: list[bool | None] = [None] * len(engines)
    for i, engine in enumerate(engines):
        try:
            had[i] = holds(engine, name)
            load_adapter(engine, name, tensors, cfg, shared, listed=had[i])
            loaded.append(i)
        except Exception as exc:  # noqa: BLE001 - said by the caller, naming the replica
            failed[i] = f"{type(exc).__name__}: {exc}"
            if not keep_going:
                break
    return loaded, failed, had


def put_back(engine: Any, name: str, previous: AdapterCopy | None, had: bool | None) -> str | None:
    """Put ``engine`` back on the adapter it served under ``name`` before this sync: ``previous``
    (the copy of the one last loaded), or none where it held none (``had`` False). None once it
    is back, else why it could not be."""
    try:
        if previous is not None and previous.tensors is not None:
            load_adapter(engine, name, previous.tensors, previous.cfg)
            return None
        if had is False:
            if holds(engine, name):
                engine.unload_lora_adapter(name)
            return None
    except Exception as exc:  # noqa: BLE001 - said by the caller, naming the replica
        return f"could not be put back ({type(exc).__name__}: {exc})"
    return "could not be put back (it held an adapter of that name this manager has no copy of)"


def check_digests(engine: Any, name: str, named: Any) -> tuple[str | None, dict[str, Any]]:
    """Verify adapter ``name`` through the engine's digests (``engine.lora_checksums(name)``:
    ``fsdp-sync serve`` over HTTP) against the same digests of ``named`` (what was sent, cast to
    the engine's dtype): ``(error naming the first tensor that differs, is missing or extra, or
    None; figures: verify_tensors, verify_s, digests)``."""
    t0 = time.perf_counter()
    sums, dtype = engine.lora_checksums(name)
    want_dtype = getattr(torch, dtype, None)
    if not isinstance(want_dtype, torch.dtype):
        return f"verify: the engine's adapter {name!r} is held in {dtype!r}, not one dtype", {}
    want = {n.removeprefix("base_model.model."): t for n, t in named}
    digests = {n: tensor_digest(n, t.detach().to(want_dtype)) for n, t in want.items()}
    figures = {"verify_tensors": len(digests), "verify_s": time.perf_counter() - t0,
               "digests": digests}
    for n, d in digests.items():
        if n not in sums:
            return f"verify: the engine's adapter {name!r} has no {n!r}", figures
        if sums[n] != d:
            return (f"verify: adapter {name!r} tensor {n!r} in the engine differs from what was "
                    f"sent (digest {sums[n][:12]} != {d[:12]})"), figures
    extra = sorted(set(sums) - set(digests))
    if extra:
        return f"verify: the engine's adapter {name!r} holds {extra[:3]} that was not sent", figures
    return None, figures


def verify_adapter(engine: Any, name: str, tensors: dict[str, torch.Tensor]) -> str | None:
    """Compare the engine's adapter with ``tensors`` bit for bit; a message naming the first
    tensor that differs (or None). An engine that cannot hand its tensors back but reports their
    digests (`SGLangEngine` over ``fsdp-sync serve``) is checked by digest (`check_digests`)."""
    read = getattr(engine, "lora_tensors", None)
    if not callable(read) and callable(getattr(engine, "lora_checksums", None)):
        try:
            return check_digests(engine, name, tensors.items())[0]
        except Exception as exc:  # noqa: BLE001 - SGLang itself has no such route: said by name
            return f"verify: {type(exc).__name__}: {exc}"
    if not callable(read):
        return (f"verify: the engine {type(engine).__name__} cannot read its LoRA adapter back; "
                f"set SyncConfig.verify='off' for adapter syncs into it")
    per_rank = getattr(engine, "lora_rank_pieces", None)
    if callable(per_rank):      # every rank's copy, replicas included (the full tensor shows one)
        err = _compare_rank_pieces(name, per_rank(name), tensors)
        if err is not None:
            return err
    try:
        got = read(name)
    except Exception as exc:  # noqa: BLE001 - a replica that differs between ranks, said by name
        return f"verify: {type(exc).__name__}: {exc}"
    for n, want in tensors.items():
        short = n.removeprefix("base_model.model.")
        g = got.get(short)
        if g is None:
            return f"verify: the engine's adapter {name!r} has no {short!r}"
        w = want.detach().to(device=g.device, dtype=g.dtype)   # a CUDA trainer's beside the CPU read-back
        if g.shape != w.shape or not torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)):
            diff = (g.float() - w.float()).abs()
            return (f"verify: adapter {name!r} tensor {short!r} differs from the trainer's "
                    f"(max abs difference {float(diff.max()) if diff.numel() else 0.0:.3g})")
    extra = sorted(set(got) - {n.removeprefix("base_model.model.") for n in tensors})
    if extra:
        return f"verify: the engine's adapter {name!r} holds {extra[:3]} that the trainer does not"
    return None


def _compare_rank_pieces(name: str, pieces: dict, tensors: dict[str, torch.Tensor]) -> str | None:
    """Each TP rank's piece of each adapter tensor against the same block of the trainer's, bit
    for bit: a message naming the first tensor and rank that differ, or None (a missing or extra
    tensor, or a shape that cannot hold the piece, is left to the full-tensor comparison)."""
    want = {n.removeprefix("base_model.model."): t for n, t in tensors.items()}
    for rank, named in pieces.items():
        for n, lst in named.items():
            if n not in want:
                continue
            for src, t in lst:
                try:
                    ref = want[n].detach().to(device=t.device, dtype=t.dtype)[src].contiguous()
                except (IndexError, RuntimeError):
                    continue
                if t.shape != ref.shape:
                    continue
                if not torch.equal(t.contiguous().view(torch.uint8), ref.view(torch.uint8)):
                    diff = (t.float() - ref.float()).abs()
                    return (f"verify: adapter {name!r} tensor {n!r} on TP rank {rank} differs from "
                            f"the trainer's (max abs difference "
                            f"{float(diff.max()) if diff.numel() else 0.0:.3g})")
    return None
