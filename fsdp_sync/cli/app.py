"""The ``fsdp-sync`` command: ``demo`` (train → sync → generate → check) and ``bench``.

Only argument parsing and printing live here; the work is in `demo` and `bench`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from . import args as ca

__all__ = ["main", "build_parser", "parse_args"]


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo", help="train a small model on N ranks and sync it into the reference engine each step",
        description="Train a small model (Qwen2 by default; Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral recipes too; no download) under FSDP on N local ranks; after each step sync "
                    "the weights into a colocated reference engine with FSDPShardingManager, generate "
                    "greedily, and check the engine's logits and tokens against the trainer's own. "
                    "Prints one row per step; exits non-zero on any mismatch.",
        formatter_class=ca.DefaultsFormatter)
    p.add_argument("--ranks", type=ca.positive_int, default=2, help="trainer ranks (processes), a multiple of --tp")
    p.add_argument("--tp", type=ca.positive_int, default=2, help="engine tensor-parallel size (infer_tp); ranks/tp = dp")
    p.add_argument("--steps", type=ca.positive_int, default=3, help="training steps, each followed by a sync")
    p.add_argument("--strategy", choices=["flattened", "bucketed", "per_tensor"], default="flattened",
                   help="flattened: one handle per bucket; bucketed: one engine call per bucket; "
                        "per_tensor: verl's one-parameter-at-a-time baseline")
    p.add_argument("--bucket-mb", type=ca.mib, default=64.0, help="bucket size in MiB (> 0)")
    p.add_argument("--method", choices=["tensor", "distributed", "disk"], default="tensor",
                   help="tensor: colocated engine, handle tuples; distributed: disaggregated engine "
                        "(own processes) reached by a broadcast from trainer rank 0; disk: a versioned "
                        "checkpoint the engine reloads")
    p.add_argument("--disk-dir", metavar="DIR", default=None,
                   help="--method disk: where each step's checkpoint goes (default: a temp directory, "
                        "removed at the end)")
    p.add_argument("--layout", choices=["auto", "full", "engine"], default="auto",
                   help="SyncConfig.layout: engine (each engine rank receives only its shard; the "
                        "disk method writes per-rank files), full (full tensors to every rank; the "
                        "disk method writes a portable Hugging Face checkpoint), auto (engine where "
                        "the engine takes it)")
    p.add_argument("--ep", type=ca.positive_int, default=1,
                   help="MoE models: the engine's expert-parallel size inside its TP group (SGLang's "
                        "--ep-size; divides --tp and the number of experts)")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="the rollout's weight format: fp8 = block FP8 as SGLang's --quantization fp8 "
                        "(quantized on the trainer each sync; the engine holds FP8 and is checked "
                        "against the trainer's weights quantized the same way; the model's TP split "
                        "must not cut a 128 block: try --model tiny-fp8)")
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=2, help="FSDP version of the trainer")
    p.add_argument("--model", type=ca.model_spec, default="tiny",
                   help="a recipe name from fsdp_sync/recipes/models (tiny, tiny-tied, small, qwen2-160m, "
                        "tiny-qwen3, tiny-qwen3-moe, tiny-qwen2-moe, tiny-mixtral, tiny-fp8, ...) or a path to a "
                        "YAML recipe / Hugging Face config.json (default: tiny; tiny-fp8 with "
                        "--quantization fp8)")
    p.add_argument("--device", type=ca.device, default="cpu", help="cpu or cuda (cuda needs a visible GPU)")
    p.add_argument("--backend", type=ca.backend, default=None, help=ca.BACKEND_HELP)
    p.add_argument("--dtype", type=ca.dtype_name, default="float32",
                   help=f"rollout dtype the weights are cast to: {', '.join(ca.DTYPES)}")
    p.add_argument("--no-multi-stage", action="store_true", help="resume all engine memory before the sync")
    p.add_argument("--atol", type=ca.nonnegative_float, default=None,
                   help="largest |logit diff| accepted (default: 1e-5 in float32; in bfloat16/float16 "
                        "4 units of the dtype's rounding at the largest logit, against the trainer's "
                        "weights cast to that dtype)")
    p.add_argument("--lora", action="store_true",
                   help="freeze the base, train a LoRA adapter on every linear layer and sync it as an "
                        "adapter (SyncConfig.lora='adapter': the base once, then the adapter alone)")
    p.add_argument("--lora-r", type=ca.positive_int, default=16, help="--lora: the adapter's rank r")
    p.add_argument("--lora-alpha", type=ca.positive_float, default=32.0,
                   help="--lora: lora_alpha (the adapter is scaled by lora_alpha / r)")
    p.add_argument("--timeout-s", type=ca.positive_float, default=None, metavar="SECONDS",
                   help="stop every rank and fail (exit 1) once the run has taken this long; the steps "
                        "every rank finished are kept: shown and written to --json (default: 600 s + 60 s "
                        "a step, each + 1 s per 10 M parameters)")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(check=_check_demo)


def _demo_options(args):
    from .demo import DemoOptions

    return DemoOptions(ranks=args.ranks, tp=args.tp, steps=args.steps, strategy=args.strategy,
                       bucket_mb=args.bucket_mb, fsdp=args.fsdp, model=args.model, device=args.device,
                       dtype=args.dtype, multi_stage_wake_up=not args.no_multi_stage, atol=args.atol,
                       progress=not args.no_progress, method=args.method,
                       disk_dir=args.disk_dir, layout=args.layout, ep=args.ep, backend=args.backend,
                       quantization=None if args.quantization == "none" else args.quantization,
                       lora_r=args.lora_r if args.lora else 0, lora_alpha=args.lora_alpha)


def _check_demo(args, given: set[str]) -> None:
    """Cross-flag checks before anything starts (ValueError names the flags): the SyncConfig the
    flags make, the model (family, TP/EP split, FP8 blocks), its size against this machine's
    memory, --disk-dir. (The output paths: `cli.args.check_outputs`, after this.)"""
    from . import demo_check

    if {"lora_r", "lora_alpha"} & given and not args.lora:
        raise ValueError("--lora-r / --lora-alpha configure the adapter of --lora; add --lora")
    if "disk_dir" in given and args.method != "disk":     # a flag the run would ignore is refused
        raise ValueError(f"--disk-dir is where --method disk writes its versions; --method {args.method} "
                         f"writes none: add --method disk or drop --disk-dir {args.disk_dir}")
    if args.ranks % args.tp:
        raise ValueError(f"--ranks {args.ranks} must be a multiple of --tp {args.tp} (dp = ranks / tp)")
    if args.quantization == "fp8" and "model" not in given:
        args.model = "tiny-fp8"         # the default that takes FP8 blocks at every --tp it splits
    ca.check_gpus(args.method, args.device, args.ranks, args.tp)
    ca.check_backend(args.backend)
    quant = None if args.quantization == "none" else args.quantization
    demo_check.check_sync_config(strategy=args.strategy, bucket_mb=args.bucket_mb, method=args.method,
                                 layout=args.layout, dtype=args.dtype, quantization=quant, lora=args.lora)
    config = demo_check.check_model(args.model, args.tp, args.ep, quant)
    if args.method == "disk" and args.disk_dir is not None:
        demo_check.check_disk_dir(args.disk_dir)
    demo_check.check_fits(args.model, config, ranks=args.ranks, tp=args.tp, method=args.method,
                          dtype=args.dtype, quantization=quant, device=args.device)
    args.opts = _demo_options(args)


def _cmd_demo(args) -> int:
    from rich.console import Console

    from .demo import DemoIncomplete, default_timeout_s, run_demo

    opts = getattr(args, "opts", None) or _demo_options(args)
    console = Console(width=None if sys.stdout.isatty() else 180)
    console.print(f"[bold]fsdp-sync demo[/]: {opts.ranks} ranks (dp {opts.ranks // opts.tp} × infer_tp "
                  f"{opts.tp}), FSDP{opts.fsdp}, model {opts.model}, method {opts.method}, strategy {opts.strategy}, "
                  f"{opts.dtype}{' + block FP8' if opts.quantization else ''}, {opts.device}")
    timeout_s = args.timeout_s or default_timeout_s(opts)
    try:
        result = run_demo(opts, timeout_s=timeout_s)
    except DemoIncomplete as exc:   # a rank failed, died or ran out of time: its last line, not a traceback
        done = exc.result["steps"]
        if done:                     # the steps every rank finished, as a full run shows them
            _demo_table(console, exc.result, opts)
        _demo_json(console, args, exc.result)
        lines = str(exc).strip().splitlines()
        why = lines[0].rstrip(":") + (f": {lines[-1]}" if len(lines) > 1 else "")
        kept = f"{len(done)} of {opts.steps} steps finished, shown above" if done else "no step finished"
        if "deadline" in lines[0]:
            why += f" (--timeout-s {timeout_s:g}; {kept}: give it more)"
        else:
            why += f" ({kept})"
        print(f"fsdp-sync demo: error: {why}", file=sys.stderr)
        return 1
    _demo_table(console, result, opts)
    _demo_json(console, args, result)
    if not result["ok"]:
        console.print(f"[red bold]MISMATCH[/]: the engine does not reproduce the trainer "
                      f"(atol {min(st['atol'] for st in result['steps']):.3g}, tokens must match, "
                      f"logits must change every step)")
        return 1
    console.print(f"[green]ok[/]: engine matched the trainer after every step ({result['wall_seconds']:.1f} s)")
    return 0


def _demo_json(console, args, result: dict) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        console.print(f"wrote {args.json}")


def _demo_table(console, result: dict, opts) -> None:
    """The demo's table of steps and what the last one shows."""
    from rich.table import Table

    table = Table(title="weight sync per training step")
    for col in ("step", "loss", "sync s", "GB/s", "bytes", "peak trainer RSS", "peak engine RSS",
                "max |logit diff|", "tokens match"):
        table.add_column(col, justify="right")
    for s in result["steps"]:
        gbps = s["bytes"] / s["sync_seconds"] / 1e9 if s["sync_seconds"] else 0.0
        table.add_row(str(s["step"]), f"{s['loss']:.4f}", f"{s['sync_seconds']:.4f}", f"{gbps:.3f}",
                      f"{s['bytes']:,}", f"{s['peak_trainer_rss'] / 2**20:.0f} MiB",
                      f"{s['peak_engine_rss'] / 2**20:.0f} MiB", f"{s['max_abs_logit_diff']:.2e}",
                      "yes" if s["tokens_match"] else "[red]NO[/]")
    console.print(table)
    stages = result["steps"][-1]["stages"]
    console.print("last step's stages: " + " → ".join(f"{st['name']} {st['seconds'] * 1e3:.1f} ms"
                                                      for st in stages))
    last = result["steps"][-1]
    console.print(f"layout: {last.get('layout') or 'n/a'}")
    if opts.lora_r:
        first = result["steps"][0]
        console.print(f"lora (r {opts.lora_r}, alpha {opts.lora_alpha:g}): the first sync sent the base "
                      f"({first.get('base_bytes') or 0:,} bytes) and the adapter; every sync sends the "
                      f"adapter alone ({last['bytes']:,} bytes)")
    ckpt = last.get("checkpoint")
    if ckpt:
        kept = "kept" if opts.disk_dir else "removed at the end (give --disk-dir DIR to keep it)"
        console.print(f"checkpoint of the last step: {ckpt['path']} ({ckpt['kind']}, "
                      f"{len(ckpt['files'])} files: {', '.join(ckpt['files'][:6])}"
                      f"{' …' if len(ckpt['files']) > 6 else ''}); {kept}")


def build_parser() -> argparse.ArgumentParser:
    parser = ca.Parser(
        prog="fsdp-sync",
        description="Weight sync from FSDP trainers to rollout engines: demo and benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    from .bench.main import add_bench_parser

    add_bench_parser(sub)
    from .plan import add_plan_parser

    add_plan_parser(sub)
    from .serve import add_serve_parser

    add_serve_parser(sub)
    from .faults import add_faults_parser

    add_faults_parser(sub)
    from .soak import add_soak_parser

    add_soak_parser(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; a bad flag exits with one line and code 2 before
    anything starts. The subcommand's ``check`` (cross-flag rules) sees which flags were given;
    then every output flag (`cli.args.OUTPUTS`: --json, --save-cluster, --png, --plot) is checked
    writable, so a long run never ends in a traceback that loses its work."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    subparser = sub.choices[args.command]
    try:
        if check is not None:
            given = ca.explicit_dests(subparser, argv[argv.index(args.command) + 1:])
            with ca.quiet_transformers():
                check(args, given)
        ca.check_outputs(args)      # before the run: its work is not lost to a bad --json
    except (ValueError, FileNotFoundError, argparse.ArgumentTypeError) as exc:
        subparser.error(str(exc))
    return args


# what each subcommand imports beyond the library: the ``cli`` extra (pyproject.toml) installs them
_RICH_COMMANDS = ("demo", "bench", "plan", "faults", "soak")


def missing_dependency(args: argparse.Namespace) -> str | None:
    """One line saying which package of the ``cli`` extra this command needs and how to install
    it, or None when every package it will import is there."""
    import importlib.util

    needs = []
    if args.command in _RICH_COMMANDS:
        needs.append("rich")
    if getattr(args, "plot", None):      # soak plots only where matplotlib is (it says so)
        needs.append("matplotlib")
    missing = [n for n in needs if importlib.util.find_spec(n) is None]
    if not missing:
        return None
    return (f"fsdp-sync {args.command}: needs {' and '.join(missing)}, which the library does not "
            f"install: pip install {' '.join(missing)} (or, in your clone of fsdp_sync, "
            f"pip install -e '.[cli]')")


class Terminated(KeyboardInterrupt):
    """A SIGTERM (``kill``, ``timeout``, a batch scheduler, ``docker stop``), raised in the main
    thread as a Ctrl-C is, so the job it ends is left the way a Ctrl-C leaves it: its ranks and
    their engine workers stopped (`launch.run_ranks`). SIGTERM's default ended this process at once
    and left them running (re-parented, holding memory and their engine workers) until their
    process-group timeout."""


def _on_sigterm(signum, frame) -> None:
    # once: a second SIGTERM while the ranks are being stopped would cut that short and leave them
    signal.signal(signal.SIGTERM, lambda *_: None)
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_dependency(args)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if args.command == "serve":      # Ctrl-C is how a server is stopped: its own handler
        from .serve import main_serve

        return main_serve(args)
    main_thread = threading.current_thread() is threading.main_thread()   # signals: main thread only
    old = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return _run(args)
    except Terminated:              # as a Ctrl-C: the ranks are stopped; 128 + SIGTERM, as a shell says
        print(f"fsdp-sync {args.command}: terminated (SIGTERM); its processes were stopped", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:       # the ranks are stopped (`launch.run_ranks`): one line, not a traceback
        print(f"fsdp-sync {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return _cmd_demo(args)
    if args.command == "bench":
        from .bench.main import cmd_bench

        return cmd_bench(args)
    if getattr(args, "run", None) is not None:   # faults, soak: the subcommand's own runner
        return args.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
