"""``fsdp-sync serve``: its flags (each checked before any worker starts) and the command that runs
the reference engine behind `fsdp_sync.engines.reference.serve.EngineServer` until SIGINT/SIGTERM or a dead worker.

Not here: the HTTP server and its routes (`fsdp_sync.engines.reference.serve`), the engine (`engines.reference`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from ..engines.reference.serve import DEFAULT_MAX_BODY, EngineServer
from . import args as ca

__all__ = ["add_serve_parser", "check_serve_args", "main_serve"]


def add_serve_parser(sub) -> None:
    import argparse


    p = sub.add_parser(
        "serve", help="serve the reference engine behind SGLang's HTTP endpoints",
        description="Start the reference engine (TP worker processes on this machine) behind "
                    "SGLang's HTTP routes, so SGLangEngine(base_url=...) or verl's SGLang client "
                    "can drive it. Binds 127.0.0.1 unless --host says otherwise. Every flag is "
                    "checked before any worker starts (one line naming the flag, exit code 2). "
                    "Exits 0 on SIGINT/SIGTERM, 1 when an engine worker dies.",
        formatter_class=ca.DefaultsFormatter)
    p.add_argument("--model", default="tiny", type=ca.model_spec,
                   help="a recipe name, YAML recipe or HF config.json (default: tiny; tiny-fp8 "
                        "with --quantization fp8, whose blocks tiny's split would cut)")
    p.add_argument("--tp", type=ca.positive_int, default=1,
                   help="engine tensor-parallel size (must divide the model's heads)")
    p.add_argument("--ep", type=ca.positive_int, default=1,
                   help="MoE models: expert-parallel size inside the TP group (SGLang's --ep-size; "
                        "must divide --tp and the number of experts)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weight and activation dtype")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: hold the weights in block-wise FP8, as SGLang's --quantization fp8 "
                        "(each quantized linear weight float8_e4m3fn plus a float32 "
                        "weight_scale_inv per 128x128 block; updates must send them so). Needs a "
                        "model whose per-rank projection sizes are multiples of 128 (e.g. "
                        "--model tiny-fp8). A config.json with a block-FP8 quantization_config "
                        "turns it on by itself")
    p.add_argument("--device", type=ca.device, default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=ca.non_negative_int, default=0,
                   help="seed of the initial random weights")
    p.add_argument("--kv-cache-tokens", type=ca.positive_int, default=None,
                   help="KV-cache slots (tokens) per TP worker; a request needs prompt + "
                        "max_new_tokens of them (default: 4096)")
    p.add_argument("--context-length", type=ca.positive_int, default=None,
                   help="hold requests to this many tokens (prompt + new), as SGLang's "
                        "--context-length (default: derived from the model config as SGLang "
                        "derives it, rope_scaling included; longer is refused unless "
                        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1)")
    p.add_argument("--weights-cpu-backup", action="store_true",
                   help="keep weights' contents across a release (SGLang's --enable-weights-cpu-backup)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    p.add_argument("--port", type=_port, default=30000, help="port (0: any free port)")
    # the default is read in main_serve, never here: --help must not print a secret
    p.add_argument("--api-key", type=_api_key, default=None,
                   help="require 'Authorization: Bearer KEY' on every request but /health and "
                        "/ready (default: the value of $FSDP_SYNC_API_KEY when it is set and "
                        "not empty; otherwise no key)")
    p.add_argument("--allowed-disk-dir", action="append", default=[], metavar="DIR",
                   type=_existing_dir,
                   help="a directory update_weights_from_disk may read from (repeatable); "
                        "without one, disk updates are refused")
    p.add_argument("--max-body-mb", type=ca.mib, default=DEFAULT_MAX_BODY / 2**20,
                   help="largest request body accepted")
    p.add_argument("--max-concurrent", type=ca.positive_int, default=32,
                   help="generation requests (/generate, /health_generate) served at once; "
                        "more get 503 (health, control and update routes are not counted)")
    p.add_argument("--update-wait-s", type=_finite_seconds, default=60.0,
                   help="how long a weight update waits to start (for a running update, or for "
                        "running requests to finish) before it gets 503 and is dropped (0: not at "
                        "all)")
    p.add_argument("--update-recv-timeout-s", type=_positive_seconds, default=60.0,
                   help="how long a worker waits in a weight-update group (joining it, or one "
                        "broadcast of update_weights_from_distributed) before it gives up; the "
                        "update is then refused and the previous weights serve. Raise it when a "
                        "trainer may take longer than this between two buckets of one sync")
    p.set_defaults(check=check_serve_args)


def _port(text: str) -> int:
    import argparse

    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return v


def _api_key(text: str) -> str:
    import argparse

    if not text.strip():
        raise argparse.ArgumentTypeError("expected a non-empty key (leave --api-key out to serve "
                                         "without one)")
    return text


def _existing_dir(text: str) -> str:
    import argparse

    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {text!r}")
    return text


def _finite_seconds(text: str) -> float:
    import argparse

    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return v


def _positive_seconds(text: str) -> float:
    import argparse

    v = _finite_seconds(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return v


def check_serve_args(args, given: set[str]) -> None:
    """Cross-flag and environment checks of `serve`, before any worker starts: the model splits
    over ``--tp`` and ``--ep`` (with ``--quantization fp8``, in whole 128 blocks), and
    ``--host``/``--port`` can be bound. Raises ValueError naming the flag."""
    import errno
    import socket

    from ..engines.reference.quant import engine_layout, resolve
    from ..models import load_config
    from ..weights.layout import ModelSpec, TPLayout

    if args.quantization == "fp8" and "model" not in given:
        args.model = "tiny-fp8"         # the default that takes FP8 blocks at every --tp it splits
    try:
        config = load_config(args.model)
        spec = ModelSpec.from_config(config)
    except ValueError as exc:
        raise ValueError(f"argument --model: {exc}") from None
    try:
        TPLayout(spec, args.tp)
    except ValueError as exc:
        raise ValueError(f"argument --tp: model {args.model!r} cannot be split over {args.tp} "
                         f"TP ranks: {exc}") from None
    try:
        TPLayout(spec, args.tp, args.ep)
    except ValueError as exc:
        raise ValueError(f"argument --ep: {exc}") from None
    if args.context_length is not None:
        from ..engines.reference.rollout import check_context_length
        try:
            check_context_length(config, args.context_length)
        except ValueError as exc:
            raise ValueError(f"argument --context-length: {exc}") from None
    flag = "--quantization" if args.quantization else "--model"
    try:
        engine_layout(spec, args.tp, args.ep, resolve(config, args.quantization))
    except ValueError as exc:
        raise ValueError(f"argument {flag}: {exc}") from None
    try:
        infos = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"argument --host: cannot resolve {args.host!r} ({exc})") from None
    try:
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            # as the server binds (allow_reuse_address): a port left in TIME-WAIT by the last serve
            # is free to it, one another socket listens on is still refused
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(infos[0][4])     # port 0: checks the address alone
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:     # resolves, but is no address of this machine
            raise ValueError(f"argument --host: cannot bind {args.host!r}: it is not an address of "
                             f"this machine ({exc.strerror or exc})") from None
        raise ValueError(f"argument --port: cannot bind {args.host}:{args.port} "
                         f"({exc.strerror or exc}); pick another port, or 0 for any free "
                         f"one") from None


def main_serve(args) -> int:
    import torch

    from ..config import parse_dtype
    from ..engines.reference import ReferenceEngine

    if args.api_key is None:
        args.api_key = os.environ.get("FSDP_SYNC_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach this "
              f"address can replace the weights", file=sys.stderr, flush=True)
    engine = server = None
    rc = 0
    stop = threading.Event()
    starting = True

    def on_signal(signum, frame):
        nonlocal starting
        stop.set()
        if starting:      # the engine's constructor stops the workers it started, on the way out
            starting = False
            raise KeyboardInterrupt

    # before the engine: its workers join a store this process hosts, and a SIGTERM that ends this
    # process meanwhile leaves them waiting for it until their store timeout (about a minute)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            engine = ReferenceEngine(args.model, tp_size=args.tp, ep_size=args.ep, device=args.device,
                                     dtype=parse_dtype(args.dtype) or torch.float32,
                                     kv_cache_tokens=args.kv_cache_tokens, seed=args.seed,
                                     weights_cpu_backup=args.weights_cpu_backup,
                                     quantization=args.quantization,
                                     update_recv_timeout_s=args.update_recv_timeout_s)
            starting = False
            if args.context_length is not None:
                engine.set_context_length(args.context_length)
        except KeyboardInterrupt:
            print("fsdp-sync serve: stopped while starting", flush=True)
            return 0
        server = EngineServer(engine, host=args.host, port=args.port, api_key=args.api_key,
                              allowed_disk_dirs=args.allowed_disk_dir,
                              max_body_bytes=int(args.max_body_mb * 2**20),
                              max_concurrent=args.max_concurrent, update_wait_s=args.update_wait_s,
                              model_path=str(args.model)).start()
        print(f"fsdp-sync serve: {engine!r} on {server.url} (api key "
              f"{'required' if args.api_key else 'off'}, disk dirs {server.allowed_disk_dirs})",
              flush=True)
        while not stop.wait(0.2):
            dead = engine.dead_reason()
            if dead is not None:
                # as SGLang's server does when a scheduler process dies: stop, and say why
                print(f"fsdp-sync serve: the engine is dead, exiting: {dead}", file=sys.stderr,
                      flush=True)
                rc = 1
                break
    finally:
        if server is not None:
            server.close()
        if engine is not None:
            engine.shutdown()
        if server is not None:
            # requests in flight end with EngineClosedError: let their 503 go out before exiting
            server.wait_idle(5.0)
        for s, h in old.items():
            signal.signal(s, h)
    print("fsdp-sync serve: stopped", flush=True)
    return rc
