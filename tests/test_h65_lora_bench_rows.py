"""`fsdp-sync bench --lora-r` (`cli.bench.lora`): its rows as the module docstring and docs/lora.md
say (H65's mutation pass; each of these mutants survived test_lora_sync's real run, whose check
passes and whose seconds are whatever the machine gives): ``seconds`` is the median of the timed
rounds' ``sync_weights`` stage, the warm-up round left out; ``speedup`` the full row's seconds
over the adapter's; ``bytes``/``tensors`` of the full row the base's plus the adapter's; and an
engine whose logits with the adapter are not the trainer's (beyond 1e-5) fails the run: ``ok``
false, exit code 1, the JSON still written.

In this process: a one-rank gloo world, the manager and engine replaced by stand-ins that give
known figures (a real LoRA bench is `test_lora_sync.test_demo_lora_and_bench_row`)."""

from __future__ import annotations

import json
import types

import pytest
import torch

BASE, ADAPTER = 560_000, 32_768
# per mode: the warm-up round's stage seconds, then the timed rounds'
SECONDS = {"full": [100.0, 0.9, 0.7, 0.8], "adapter": [50.0, 0.03, 0.01, 0.02]}


@pytest.fixture
def stand_ins(monkeypatch):
    from fsdp_sync import engines, manager
    from fsdp_sync.cli import lora_model, trainer

    log = types.SimpleNamespace(off=0.0, closed=0, shutdown=0, modes=[])

    class Engine:
        def __init__(self, **kw):
            assert kw["max_lora_rank"] == 4, kw

        def forward_logits(self, prompts, lora_path=None):
            assert lora_path == "fsdp_sync_lora", lora_path      # SyncConfig.lora_name
            return torch.zeros(len(prompts), 8) + log.off

        def shutdown(self):
            log.shutdown += 1

    class Manager:
        def __init__(self, model, engine, mesh=None, config=None):
            assert config.lora == "adapter" and config.bucket_bytes == 2 << 20, config
            self.config, self.base_sync_done, self._n = config, False, {"full": 0, "adapter": 0}

        def __enter__(self):
            mode = "adapter" if self.base_sync_done else "full"
            log.modes.append(mode)
            secs = SECONDS[mode][self._n[mode]]
            self._n[mode] += 1
            extra = {} if mode == "adapter" else {"base_bytes": BASE, "base_tensors": 27}
            self.stats = types.SimpleNamespace(bytes=ADAPTER, tensors=28, engine_calls=1, extra=extra)
            self.timeline = types.SimpleNamespace(stages=[types.SimpleNamespace(name="resume_weights", seconds=9.0),
                                                          types.SimpleNamespace(name="sync_weights", seconds=secs)])
            return self

        def __exit__(self, *exc):
            return False

        def close(self):
            log.closed += 1

    monkeypatch.setattr(engines, "ReferenceEngine", Engine)
    monkeypatch.setattr(manager, "FSDPShardingManager", Manager)
    monkeypatch.setattr(trainer, "wrap_fsdp", lambda module, version, **kw: module)
    monkeypatch.setattr(lora_model, "add_lora", lambda module, r, alpha: module)     # the figures are the stand-ins'
    monkeypatch.setattr(trainer, "last_logits", lambda model, prompts: torch.zeros(len(prompts), 8))
    return log


def _opts(repeats: int = 3) -> dict:
    return {"model": "tiny", "tp": 1, "r": 4, "alpha": 8.0, "repeats": repeats, "bucket_mb": 2.0}


def test_rows_are_the_timed_rounds_medians_and_their_ratios(one_rank, stand_ins):
    from fsdp_sync.cli.bench.lora import lora_bench_rank

    stand_ins.off = 3e-6
    out = lora_bench_rank(0, 1, _opts())
    full, adapter = out["rows"]
    assert stand_ins.modes == ["full", "adapter"] * 4, stand_ins.modes      # a warm-up round + 3
    assert full["all_seconds"] == SECONDS["full"][1:] and adapter["all_seconds"] == SECONDS["adapter"][1:]
    assert full["seconds"] == 0.8 and adapter["seconds"] == 0.02, (full, adapter)
    assert adapter["speedup"] == pytest.approx(0.8 / 0.02) and "speedup" not in full
    assert (full["bytes"], full["adapter_bytes"], full["tensors"]) == (BASE + ADAPTER, ADAPTER, 55), full
    assert (adapter["bytes"], adapter["tensors"]) == (ADAPTER, 28), adapter
    assert adapter["bytes_ratio"] == ADAPTER / (BASE + ADAPTER)
    for r, mode in ((full, "full"), (adapter, "adapter")):
        assert (r["mode"], r["lora_r"], r["lora_alpha"], r["ranks"], r["tp"], r["bucket_bytes"]) == \
            (mode, 4, 8.0, 1, 1, 2 << 20), r
        assert (r["method"], r["strategy"], r["dtype"], r["device"]) == ("tensor", "flattened", "float32", "cpu")
    assert out["max_abs_logit_diff"] == pytest.approx(3e-6)
    assert stand_ins.closed == 1 and stand_ins.shutdown == 1


@pytest.mark.parametrize("diff, ok", [(9e-6, True), (2e-5, False)])
def test_an_engine_off_the_trainer_fails_the_run(diff, ok, one_rank, stand_ins, monkeypatch, tmp_path, capsys):
    """The worst rank's logit difference decides: beyond 1e-5 the run is not ok and the command
    exits 1 (its rows still printed and written)."""
    from rich.console import Console

    from fsdp_sync.cli import launch
    from fsdp_sync.cli.app import parse_args
    from fsdp_sync.cli.bench.lora import lora_bench_rank, print_lora_bench

    stand_ins.off = diff

    def run_ranks(fn, world, opts, **kw):      # rank 0 here; a second rank with no engine
        assert world == 2 and opts["tp"] == 1 and opts["bucket_mb"] == 2.0 and opts["repeats"] == 3, opts
        return [fn(0, 1, opts), {"rows": [], "max_abs_logit_diff": None}]

    monkeypatch.setattr(launch, "run_ranks", run_ranks)
    out = tmp_path / "lora.json"
    args = parse_args(["bench", "--lora-r", "4", "--lora-alpha", "8", "--models", "tiny", "--ranks", "2",
                       "--tp", "1", "--bucket-mb", "2", "--json", str(out)])
    rc = print_lora_bench(args, Console(width=200))
    res = json.loads(out.read_text())
    assert (rc, res["ok"]) == (0 if ok else 1, ok), (rc, res)
    assert res["max_abs_logit_diff"] == pytest.approx(diff) and len(res["rows"]) == 2
    text = capsys.readouterr().out
    assert f"{diff:.2e}" in text, text
    # sizes in the unit that shows them (the table said 0.0 for the adapter's MiB)
    assert "32.0 KiB" in text and "579 KiB" in text, text
