"""Argument checking for the ``fsdp-sync`` commands: argparse ``type=`` functions and the parser.

Every flag is checked while the command line is parsed, before any process, engine or process
group starts: a bad value gives one line (``fsdp-sync demo: error: argument --tp: ...``) naming
the flag and what it accepts, and exit code 2. Cross-flag rules (``--ranks`` a multiple of
``--tp``) are checked right after parsing, through the same one-line error, and so are the output
flags (`OUTPUTS`, `check_outputs`): a path a long run would write only at its end. A new flag gets
its check by passing one of these functions as ``type=`` (or a new one written like them).

Not here: what the commands do (`demo`, `bench`) or their printing (`cli`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["Parser", "positive_int", "non_negative_int", "positive_float", "nonnegative_float", "mib", "on_off",
           "csv_of", "device", "dtype_name", "model_spec", "existing_file", "explicit_dests", "DefaultsFormatter",
           "quiet_transformers", "check_mib", "OUTPUTS", "check_output", "check_outputs", "recipe_mapping",
           "RECIPE_ALIASES", "recipe_keys_named"]

DTYPES = ("float32", "bfloat16", "float16")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code 2 (no usage block, no traceback)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` for every flag that has a default (not for flags without one, nor
    for one whose help says its default in its own words: ``(default: tiny; tiny-fp8 with ...)``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "(default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = name          # argparse names the type in "invalid <name> value" messages
    return fn


def _number(cast: Callable[[str], Any], ok: Callable[[Any], bool], expected: str, name: str) -> Callable:
    """An argparse ``type=`` that casts the text and keeps it only if ``ok``; else "expected ..."."""

    def check(text: str) -> Any:
        try:
            v = cast(text)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return v

    return _named(check, name)


positive_int = _number(int, lambda v: v >= 1, "a positive integer", "positive_int")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0", "non_negative_int")
positive_float = _number(float, lambda v: 0 < v < float("inf"), "a positive number", "positive_float")
nonnegative_float = _number(float, lambda v: 0 <= v < float("inf"), "a finite number >= 0", "nonnegative_float")


def mib(text: str) -> float:
    """A size in MiB (``--bucket-mb``, ``--max-body-mb``): a positive number that is at least one
    byte, as the command turns it into whole bytes (``int(1e-7 * 2**20)`` is 0: no bucket holds
    anything, no request body fits)."""
    v = positive_float(text)
    if int(v * 2**20) < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 byte ({1 / 2**20:.3g} MiB), got {text!r} "
                                         f"(0 bytes)")
    return v


def on_off(text: str) -> bool:
    from ..config import parse_bool

    try:
        return parse_bool(text, "value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected on or off (or true/false, yes/no, 1/0), "
                                         f"got {text!r}") from None


def csv_of(item: Callable[[str], Any], what: str = "") -> Callable[[str], tuple]:
    """A comma-separated list, each item checked by ``item``; at least one item."""

    def parse(text: str) -> tuple:
        items = [x.strip() for x in str(text).split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list{what}, got {text!r}")
        out = []
        for x in items:
            try:
                out.append(item(x))
            except argparse.ArgumentTypeError as exc:
                # the item's own message names it already (a path): not twice
                raise argparse.ArgumentTypeError(str(exc) if x in str(exc) else f"item {x!r}: {exc}") from None
        return tuple(out)

    return _named(parse, f"comma-separated {getattr(item, '__name__', 'value')}")


def choice_of(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return _named(parse, "choice")


def device(text: str) -> str:
    """``cpu`` or ``cuda``; ``cuda`` only where this process sees a CUDA device."""
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    if text == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("cuda requested but this machine has no CUDA device "
                                             "torch can use (torch.cuda.is_available() is False); "
                                             "use --device cpu")
    return text


BACKEND_HELP = ("the trainer ranks' process-group backend (default: gloo on cpu, nccl on cuda). "
                "The sync runs on any, NCCL-only included: its objects and agreement go over a gloo "
                "group of its own where the group has no CPU backend. cuda:gloo makes such a group on "
                "a CPU machine (what init_process_group('nccl') gives on GPUs)")


def backend(text: str) -> str:
    """A torch.distributed backend string: ``gloo``, ``nccl``, or a per-device map such as
    ``cpu:gloo,cuda:nccl``."""
    import re

    if not re.fullmatch(r"(gloo|nccl)|((cpu|cuda):(gloo|nccl))(,(cpu|cuda):(gloo|nccl))?", text):
        raise argparse.ArgumentTypeError(f"expected gloo, nccl or a device map such as "
                                         f"cpu:gloo,cuda:nccl, got {text!r}")
    return text


def check_backend(backend: str | None) -> None:
    """Refuse (ValueError naming ``--backend``) an NCCL backend this machine cannot start: a torch
    built without NCCL (CPU wheels), or no CUDA device (NCCL's communicators live on GPUs). Every
    rank would start, build its model and then fail in init_process_group ("Distributed package
    doesn't have NCCL built in"). Checked after parsing, not in `backend`: the spelling is the
    same everywhere, what runs depends on this machine. ``cuda:gloo`` (gloo with no CPU backend,
    the NCCL-only group's emulation) and a CPU trainer on an NCCL-only group (it shards over a
    gloo twin: `trainer.wrap_fsdp`) are not refused."""
    if not backend or "nccl" not in backend:
        return
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        why = "this torch has no NCCL built in (torch.distributed.is_nccl_available() is False)"
    elif not torch.cuda.is_available():
        why = "NCCL runs on GPUs and this machine has no CUDA device torch can use"
    else:
        return
    raise ValueError(f"argument --backend: {backend}: {why}; use gloo, or cuda:gloo for a group "
                     f"without a CPU backend (what init_process_group('nccl') gives on GPUs)")


def check_gpus(method: str, device: str, ranks: int, tp: int, gpus: int | None = None,
               method_flag: str = "--method") -> None:
    """Refuse, before anything starts, a job this machine's GPUs cannot hold: one GPU per trainer
    rank, whatever the method (rank r goes on cuda:r % GPUs, and NCCL refuses two ranks of the
    trainer's group on one GPU, after the model was built); the distributed method's engine on
    GPUs of its own (NCCL refuses one GPU on both ends of the update group), so trainer ranks on
    GPUs 0..ranks-1 and the engine's TP workers after them. ``method_flag``: bench's --methods."""
    if device != "cuda":
        return
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if ranks > gpus:
        raise ValueError(f"--device cuda --ranks {ranks} needs {ranks} GPUs (one per trainer rank: NCCL "
                         f"refuses two ranks of the trainer's group on one GPU); this machine has {gpus}. "
                         f"Use --ranks {gpus} or fewer, or --device cpu")
    if method == "distributed" and ranks + tp > gpus:
        raise ValueError(f"{method_flag} distributed --device cuda needs --ranks + --tp = {ranks + tp} GPUs "
                         f"(the engine's {tp} on GPUs of their own: NCCL refuses one GPU on both ends "
                         f"of the weight-update group); this machine has {gpus}. Use {method_flag} tensor "
                         f"(colocated, CUDA IPC) or {method_flag} disk on one GPU")


def dtype_name(text: str) -> str:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)}, got {text!r}")
    return text


def model_spec(text: str) -> str:
    """A model recipe name (`fsdp_sync.models.model_recipes`) or a path to a YAML recipe, a
    config.json or a folder holding one."""
    from ..models import model_recipes

    p = Path(text)
    if text in model_recipes() or p.is_file() or (p.is_dir() and (p / "config.json").is_file()):
        return text
    raise argparse.ArgumentTypeError(f"no model recipe {text!r}: expected one of "
                                     f"{', '.join(model_recipes())} or a path to a YAML recipe / "
                                     f"config.json")


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def shipped_sweeps(kind: str) -> list[str]:
    """The sweeps shipped in ``fsdp_sync/recipes/memory_tuning/``: ``fsdp-sync plan``'s are
    ``plan_*.yaml`` (``kind="plan"``), the bench's the rest (``kind="bench"``)."""
    from ..models import RECIPES_DIR

    return sorted(p.stem for p in (RECIPES_DIR / "memory_tuning").glob("*.yaml")
                  if p.stem.startswith("plan_") == (kind == "plan"))


def sweep_of(kind: str) -> Callable[[str], str]:
    """``--recipe``: a YAML path, or the name of a shipped sweep of ``kind`` (`shipped_sweeps`);
    a name of the other command's sweeps is refused."""
    def parse(text: str) -> str:
        from ..models import RECIPES_DIR

        if Path(text).is_file():
            return text
        if text in shipped_sweeps(kind):
            return str(RECIPES_DIR / "memory_tuning" / f"{text}.yaml")
        raise argparse.ArgumentTypeError(f"no such file or shipped {'plan ' if kind == 'plan' else ''}"
                                         f"sweep: {text!r} (shipped: {', '.join(shipped_sweeps(kind))})")
    return _named(parse, "recipe")


def recipe_mapping(path: str, section: str) -> dict:
    """The keys of a ``--recipe`` YAML file: its ``section:`` (``bench``, ``plan``) when it has one,
    else the whole file. ValueError ``--recipe PATH: ...`` (one line) for a file that cannot be
    read or parsed as YAML (an unclosed ``[``, an unknown ``${...}``), or whose keys are not a
    mapping (a list at the top): what a traceback said before."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        d = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ValueError(f"--recipe {path}: not a YAML recipe: {' '.join(str(exc).split())}") from None
    d = d.get(section, d) if isinstance(d, dict) else d
    if not isinstance(d, dict):
        raise ValueError(f"--recipe {path}: expected a mapping of keys (under '{section}:'), got a "
                         f"{type(d).__name__}: {str(d)[:80]}")
    return d


RECIPE_ALIASES = {"layout": "layouts"}
"""A recipe key named as its flag (``--layout``) -> the sweep's key (``layouts``), in the bench's
and the plan's recipes alike."""


def recipe_keys_named(d: dict) -> dict:
    """A recipe's keys under the sweep's names (`RECIPE_ALIASES`); ValueError where one is given
    under both names (which of the two values would run is not for a dict's order to decide)."""
    both = sorted(f"{a!r} and {k!r}" for a, k in RECIPE_ALIASES.items() if a in d and k in d)
    if both:
        raise ValueError(f"{'; '.join(both)} name the same key: give one of them")
    return {RECIPE_ALIASES.get(k, k): v for k, v in d.items()}


def check_mib(values: Sequence[Any], flag: str) -> None:
    """Each of a sweep's sizes in MiB (its flag's or its recipe's) holds at least a byte, as
    `mib` checks one flag: ValueError naming ``flag`` (`fsdp_sync.config.mib_to_bytes`)."""
    from ..config import mib_to_bytes

    for v in values:
        mib_to_bytes(v, flag)


OUTPUTS = {"json": "file", "save_cluster": "file", "png": "file", "plot": "directory"}
"""The output flags (by ``dest``) of every command, written at the end of a run: `check_outputs`
checks them before the run starts."""


def check_output(path: str, flag: str, kind: str = "file") -> None:
    """Refuse (ValueError naming the flag and the path) an output the command could write only
    after its work is done and would then fail on: a file path that is a directory, a directory
    that is a file, or a path whose nearest existing parent is not a writable directory (missing
    parents are fine: the command makes them). Writable: an empty file is made and removed there."""
    p = Path(os.path.abspath(path))
    if kind == "file" and p.is_dir():
        raise ValueError(f"argument {flag}: {path} is a directory; expected a file path to write")
    if kind == "directory" and p.exists() and not p.is_dir():
        raise ValueError(f"argument {flag}: {path} is a file; expected a directory to write into")
    base = p if kind == "directory" else p.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"argument {flag}: cannot write {path}: {base} is not a directory")
    # a file made and removed there, not os.access: root passes access() on a directory it cannot
    # write in (/proc, a read-only bind mount some kernels report writable), and the run then ended
    # in a traceback that lost its work
    try:
        fd, probe = tempfile.mkstemp(prefix=".fsdp-sync-probe-", dir=base)
    except OSError as exc:
        raise ValueError(f"argument {flag}: cannot write {path}: {base} is not writable "
                         f"({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def check_outputs(args: argparse.Namespace) -> None:
    """`check_output` for each of `OUTPUTS` the command has and was given."""
    for dest, kind in OUTPUTS.items():
        if getattr(args, dest, None):
            check_output(str(getattr(args, dest)), "--" + dest.replace("_", "-"), kind)


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every flag given on ``argv`` (as opposed to left at its default)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        ns, _ = parser.parse_known_args(list(argv))
    finally:
        for a, default in saved:
            a.default = default
    return set(vars(ns))


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings off (errors still on) while the flags are checked: a config.json's
    warnings (``bos_token_id must be ... within the vocabulary``) would turn the one-line error
    of a refused flag into three lines."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def fail(parser: argparse.ArgumentParser, message: str) -> None:
    """The one-line error and exit code 2 of `Parser`, for checks made after parsing."""
    parser.error(message)
    sys.exit(2)   # pragma: no cover - error() exits
