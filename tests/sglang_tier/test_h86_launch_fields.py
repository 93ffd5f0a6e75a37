"""The launch arguments `SGLangEngine` reads from the installed SGLang's ``get_server_info`` to
refuse a server it cannot sync (`make test-sglang`: 0.5.23, and 0.5.12 put first on PYTHONPATH):
``tp_size`` (each sync's `check_tp_size`: a server restarted with another ``--tp-size``),
``quantization`` (`SGLangEngine.quantization`), ``dtype`` (`refusals.dtype_refusal`),
``custom_weight_loader`` (`Refusals.accepts_rank_buckets`) and ``enable_memory_saver`` (an update
into released weights, `check_tp_size`). Both releases answer the server
arguments' own fields at the top level (0.5.23: ``ServerArgs.resolved_dict()``; 0.5.12:
``dataclasses.asdict(server_args)``), so each must be a field of the installed ``ServerArgs``;
the ``--dtype`` choices must be those `SGLANG_DTYPES` reads (plus ``auto``), and an unknown
``load_format`` must reach the worker's ``NotImplementedError`` (what the refusal spares)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang


def _source(rel: str) -> str:
    """The installed release's source (read, not imported: 0.5.12's modules import torchvision)."""
    import importlib.util
    import pathlib

    root = pathlib.Path(importlib.util.find_spec("sglang").origin).parent
    return (root / rel).read_text()


def _fields() -> set[str]:
    import ast

    tree = ast.parse(_source("srt/server_args.py"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"]
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    if len(names) > 100:                               # 0.5.12: the dataclass's own fields
        return names
    from sglang.srt import server_args as sa           # 0.5.23: records in argument groups
    return {f.name for f in sa.record_fields(sa.ServerArgs)}


def test_the_launch_fields_the_adapter_reads_are_server_args_fields():
    assert {"tp_size", "quantization", "dtype", "custom_weight_loader", "load_format",
            "enable_memory_saver"} <= _fields()


def test_sglangs_dtype_names_are_the_ones_the_refusal_reads():
    import ast

    from fsdp_sync.engines.sglang.refusals import SGLANG_DTYPES

    tree = ast.parse(_source("srt/configs/model_config.py"))
    (table,) = [n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                and "_STR_DTYPE_TO_TORCH_DTYPE" in ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target)]
    theirs = {ast.literal_eval(k): v.attr for k, v in zip(table.keys, table.values)}
    assert theirs == SGLANG_DTYPES


def test_an_unregistered_load_format_raises_in_sglangs_worker():
    """Where the adapter's refusal matters: a load_format SGLang does not know is no refusal
    answer but an exception in the worker (0.5.12: model_runner; 0.5.23: its weight updater)."""
    for rel in ("srt/model_executor/model_runner_components/weight_updater.py",
                "srt/model_executor/model_runner.py"):
        try:
            src = _source(rel)
        except OSError:
            continue
        if "custom_weight_loader" in src and 'raise NotImplementedError(f"Unknown load_format' in src:
            return
    pytest.fail("no worker raising NotImplementedError on an unknown load_format")
