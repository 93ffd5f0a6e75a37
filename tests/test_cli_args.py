"""Every bad flag of ``fsdp-sync demo`` / ``bench`` is one line naming the flag, exit code 2, before
anything starts; flags given with --preset/--recipe override it (issue 9 items 7, 8, 9)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fsdp_sync.cli import app as cli

from _util import ROOT, cli_here, run_output

CUDA = torch.cuda.is_available()

BAD = [
    ("demo --ranks 3 --tp 2", ["--ranks 3", "--tp 2", "multiple"]),
    ("demo --tp 0", ["--tp", "positive integer"]),
    ("demo --ranks -2", ["--ranks", "positive integer"]),
    ("demo --steps 0", ["--steps", "positive integer"]),
    ("demo --bucket-mb 0", ["--bucket-mb", "positive number"]),
    ("demo --bucket-mb nan", ["--bucket-mb", "positive number"]),
    ("demo --dtype int8", ["--dtype", "float32, bfloat16, float16"]),
    ("demo --model nope", ["--model", "no model recipe 'nope'", "small"]),
    ("demo --atol -1", ["--atol", ">= 0"]),
    ("bench --tp 0", ["--tp", "positive integer"]),
    ("bench --multi-stage maybe", ["--multi-stage", "on or off", "'maybe'"]),
    ("bench --share-host-memory 2", ["--share-host-memory", "on or off"]),
    ("bench --bucket-mb 4,0", ["--bucket-mb", "positive number"]),
    ("bench --ranks 3", ["--ranks", "--tp", "multiple"]),
    ("bench --strategies flattened,fast", ["--strategies", "'fast'", "per_tensor"]),
    ("bench --models tiny,nope", ["--models", "'nope'"]),
    ("bench --repeats 2", ["--repeats", ">= 3"]),
    ("bench --recipe /nonexistent.yaml", ["--recipe", "no such file or shipped sweep", "bucket_sweep"]),
    ("bench --recipe plan_moe_h100", ["--recipe", "shipped sweep: 'plan_moe_h100'", "bucket_sweep"]),
    ("bench --preset quick --recipe targets", ["--recipe", "--preset"]),
    ("bench --preset nope", ["--preset", "quick, targets"]),
    ("bench --preset quick --ranks 3", ["--ranks", "--tp"]),
    ("bench --ep 3", ["--ep", "--tp", "divide"]),
    ("bench --models tiny --ep 2", ["--ep 2", "no experts"]),
    ("bench --models tiny-qwen3-moe --ranks 4 --tp 4 --ep 4,3", ["--ep", "--tp", "divide"]),
    ("soak --warmup -1", ["--warmup", "integer >= 0", "'-1'"]),
    ("soak --syncs 0", ["--syncs", "positive integer"]),
    # a bad method was SystemExit(1): the code of "target NOT met", and not the one-line form
    ("soak --methods tensor,bogus", ["argument --methods", "tensor, distributed, disk, train", "'bogus'"]),
    # serve (issue 21 item 8): each used to be a traceback, often after the workers started
    ("serve --tp 0", ["--tp", "positive integer"]),
    ("serve --tp 3", ["--tp", "'tiny'", "3 TP ranks", "num_attention_heads"]),
    ("serve --model tinny", ["--model", "no model recipe 'tinny'", "small"]),
    ("serve --port 99999", ["--port", "0..65535", "'99999'"]),
    ("serve --max-body-mb 0", ["--max-body-mb", "positive number"]),
    ("serve --allowed-disk-dir /nonexistent", ["--allowed-disk-dir", "no such directory"]),
    ("serve --api-key=", ["--api-key", "non-empty"]),
    ("serve --max-concurrent 0", ["--max-concurrent", "positive integer"]),
    ("serve --update-wait-s -1", ["--update-wait-s", "finite number of seconds >= 0"]),
    ("serve --update-wait-s inf", ["--update-wait-s", "finite"]),
    ("serve --host no.such.host.invalid --port 0", ["--host", "cannot resolve"]),
    ("serve --quantization int8", ["--quantization", "invalid choice", "'int8'"]),
    ("serve --model tiny --quantization fp8", ["--quantization", "block FP8 [128, 128] at tp 1", "q_proj rows per rank = 64",
                                  "multiple of block 128"]),
    ("serve --model tiny-fp8-moe --tp 4 --quantization fp8", ["--quantization", "tp 4, ep 1",
                                                              "expert rows per rank"]),
    # sizes that passed the flag check and crashed later (1e-7 MiB is 0 bytes; inf GiB overflowed)
    ("demo --bucket-mb 0.0000001", ["--bucket-mb", "at least 1 byte", "'0.0000001'"]),
    ("bench --bucket-mb 4,0.0000001", ["--bucket-mb", "at least 1 byte", "1e-07"]),
    ("plan --bucket-mb 0.0000001", ["--bucket-mb", "at least 1 byte", "'0.0000001'"]),
    # accepted and ignored before: the rows were those of a run without the flag
    ("plan --fsdp1-state-dict local", ["--fsdp1-state-dict local", "--fsdp 2", "add --fsdp 1"]),
    ("plan --replicas 5", ["--replicas 5", "tensor method", "--methods distributed or disk"]),
    ("plan --trainer-resident-gib inf", ["--trainer-resident-gib", "finite number >= 0", "'inf'"]),
    ("serve --max-body-mb 0.0000001", ["--max-body-mb", "at least 1 byte", "'0.0000001'"]),
    # SGLang's --context-length: longer than the config's (tiny: 256) is refused as SGLang refuses it
    ("serve --context-length 0", ["--context-length", "positive integer"]),
    ("serve --context-length 257", ["--context-length", "257 is greater than the context length "
                                    "derived from the model config (256"]),
    ("demo --strategy per_tensor --layout engine", ["--strategy per_tensor", "--layout engine",
                                                     "strategy='flattened'", "layout='full' or 'auto'"]),
    # faults: a timeout of 0 was a DistNetworkError traceback, a negative one a library FAIL
    ("faults --cell-timeout 0", ["--cell-timeout", "positive number", "'0'"]),
    ("faults --pg-timeout -1", ["--pg-timeout", "positive number", "'-1'"]),
    ("faults --call-timeout nan", ["--call-timeout", "positive number"]),
    ("faults --jobs 0", ["--jobs", "positive integer"]),
    ("faults --resume", ["--resume", "needs --json"]),
    # --fleet ran its own methods and faults when given others, and ignored the matrix's flags
    ("faults --fleet --methods tensor", ["--methods", "--fleet covers distributed, disk", "got tensor"]),
    ("faults --fleet --methods disk,tensor", ["--methods", "got tensor"]),
    ("faults --fleet --faults raise", ["--faults", "--fleet covers kill, stall", "got raise"]),
    ("faults --fleet --stages prepare --jobs 2", ["--fleet", "does not take --stages, --jobs"]),
    # flags the chosen options would ignore (accepted, exit 0, nothing done with them)
    ("demo --disk-dir /nonexistent/never_made", ["--disk-dir", "--method disk", "--method tensor writes none"]),
    ("demo --method distributed --disk-dir d", ["--disk-dir", "--method distributed writes none"]),
    ("bench --engine http --methods distributed", ["--engine http", "--methods distributed has no tensor rows"]),
    ("bench --engine direct --methods disk", ["--engine direct", "--methods disk has no tensor rows"]),
    # outputs written at the end of a long run: checked before it starts
    ("demo --json tests", ["--json", "tests is a directory", "file path"]),
    ("bench --json tests", ["--json", "tests is a directory"]),
    ("plan --save-cluster README.md/c.json", ["--save-cluster", "README.md is not a directory"]),
    ("plan --json README.md/sub/p.json", ["--json", "README.md is not a directory"]),
    ("plan --plot README.md", ["--plot", "README.md is a file", "directory"]),
    ("faults --json README.md/f.json", ["--json", "README.md is not a directory"]),
    ("soak --png README.md/s.png", ["--png", "README.md is not a directory"]),
    ("soak --json tests", ["--json", "tests is a directory"]),
] + ([] if CUDA else [("demo --device cuda", ["--device", "no CUDA"]),
                      ("bench --device cuda", ["--device", "no CUDA"]),
                      ("bench --recipe targets --device cuda",
                       ["--device", "no CUDA"]),
                      # the sweep's own device: was a traceback (an uncaught ArgumentTypeError)
                      ("bench --preset gpu", ["--preset gpu runs on cuda", "no CUDA"])])


@pytest.mark.parametrize("argv, words", BAD, ids=[a for a, _ in BAD])
def test_bad_flags_give_one_line_and_exit_2(argv, words, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv.split())
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


def test_bad_flag_from_the_shell_starts_nothing():
    # the case: --bucket-mb 0 used to start ranks and an engine, then fail with a traceback
    proc = run_output([sys.executable, "-m", "fsdp_sync.cli", "demo", "--bucket-mb", "0"],
                      cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("fsdp-sync demo: error: argument --bucket-mb: expected a positive "
                                   "number, got '0'")


def test_flags_given_with_a_preset_or_recipe_override_it(monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = cli.parse_args("bench --preset quick --dtype bfloat16 --models tiny".split()).spec
    assert spec.dtype == "bfloat16" and spec.models == ("tiny",)
    assert spec.strategies == ("flattened", "bucketed", "per_tensor")      # the rest is the preset's
    assert spec.bucket_mb == (4, 16, 64) and spec.multi_stage == (True, False)
    plain = cli.parse_args("bench --preset quick".split()).spec
    assert plain.dtype == "float32" and plain.models == ("small",)
    spec = cli.parse_args("bench --recipe bucket_sweep --repeats 5 "
                          "--multi-stage off".split()).spec
    assert spec.repeats == 5 and spec.multi_stage == (False,)
    assert cli.parse_args("bench --recipe bucket_sweep".split()).spec.repeats >= 3
    args = cli.parse_args("demo --ranks 4 --tp 2 --bucket-mb 16 --dtype bfloat16".split())
    assert (args.opts.ranks, args.opts.tp, args.opts.bucket_mb, args.opts.dtype) == (4, 2, 16.0, "bfloat16")


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--device DEVICE cpu or cuda (cuda needs a visible GPU) (default: cpu)" in out
    assert "(default: float32)" in out and "override the preset's or recipe's values" in out


def test_demo_help_says_no_default_none(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in out and "--bucket-mb BUCKET_MB bucket size in MiB (> 0) (default: 64.0)" in out


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_a_default_the_help_states_itself_is_printed_once(command, capsys):
    """``--model``'s help says its default in words (tiny; tiny-fp8 with --quantization fp8), and
    the formatter added "(default: tiny)" after it: the default twice."""
    with pytest.raises(SystemExit):
        cli.parse_args([command, "--help"])
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("  --model MODEL"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("  -"))
    model = " ".join(" ".join(lines[start:end]).split())
    assert model.count("(default:") == 1 and "(default: tiny;" in model, model


def test_serve_port_in_use_is_one_line_and_starts_no_worker():
    import socket

    import psutil

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "fsdp_sync.cli", "serve", "--port", str(port)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = set()
        while proc.poll() is None:        # watch for engine workers while it runs
            try:
                started |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                break
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == "", (out, err)
    assert err.strip().startswith("fsdp-sync serve: error: argument --port: cannot bind "
                                  f"127.0.0.1:{port}"), err
    assert len(err.strip().splitlines()) == 1 and not started, (err, started)


@pytest.mark.parametrize("host, words", [
    ("999.1.1.1", ["--host", "cannot resolve '999.1.1.1'"]),        # no such address at all
    ("192.0.2.1", ["--host", "'192.0.2.1'", "not an address of this machine"]),   # not this machine's
])
def test_serve_blames_host_for_an_address_it_cannot_bind(host, words, capsys):
    """Issue 36 item 9: ``serve --host 999.1.1.1`` (default port) said ``argument --port``."""
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["serve", "--host", host])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--port" not in err and all(w in err for w in words), err


def test_serve_help_describes_every_flag(capsys):
    """Issue 36 item 9: ``--kv-cache-tokens`` had no help text."""
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-tokens KV_CACHE_TOKENS KV-cache slots (tokens) per TP worker" in out
    assert "(default: 4096)" in out


def test_serve_help_never_prints_the_api_key(monkeypatch, capsys):
    monkeypatch.setenv("FSDP_SYNC_API_KEY", "do-not-print-me")
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "do-not-print-me" not in out and "$FSDP_SYNC_API_KEY" in out
    assert cli.parse_args(["serve"]).api_key is None      # read by main_serve, not by the parser


@pytest.mark.parametrize("argv,missing,blocked", [
    (["demo", "--steps", "1"], "rich", ["rich"]),
    (["faults"], "rich", ["rich"]),
    (["bench", "--models", "tiny", "--plot", "out"], "matplotlib", ["matplotlib"]),
    (["soak", "--png", "x.png"], "rich", ["rich", "matplotlib"]),   # soak plots only if it can
])
def test_a_command_without_its_extra_says_how_to_install_it(monkeypatch, capsys, argv, missing, blocked):
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)   # as if not installed: find_spec gives None
    assert cli.main(argv) == 2                         # before anything starts
    err = capsys.readouterr().err.strip()
    assert err == (f"fsdp-sync {argv[0]}: needs {missing}, which the library does not install: "
                   f"pip install {missing} (or, in your clone of fsdp_sync, pip install -e '.[cli]')")


def test_serve_needs_no_cli_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.missing_dependency(cli.parse_args(["serve"])) is None


def test_bench_recipe_scalars_are_one_item_lists(tmp_path, capsys):
    """Issue 21 item 9: `models: tiny` was split into letters and `bucket_mb: 1` crashed."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("bench:\n  models: tiny\n  bucket_mb: 1\n  ranks: 2\n  multi_stage: off\n")
    spec = cli.parse_args(["bench", "--recipe", str(recipe)]).spec
    assert (spec.models, spec.bucket_mb, spec.ranks, spec.multi_stage) == (("tiny",), (1.0,), (2,), (False,))
    for body, words in (("repeats: [3, 4]", "bench key 'repeats' takes one value, got [3, 4]"),
                        ("bucket_mb: abc", "bench key 'bucket_mb'"),
                        ("ranks: [two]", "bench key 'ranks': expected a positive integer, got 'two'")):
        recipe.write_text(f"bench:\n  {body}\n")
        with pytest.raises(SystemExit) as info:
            cli.parse_args(["bench", "--recipe", str(recipe)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and words in err, err


def test_bench_and_plan_recipes_take_layout_as_the_flag_names_it(tmp_path, capsys):
    """A plan recipe took ``layout`` (the flag's name, --layout) for ``layouts``; a bench recipe
    refused it (unknown bench keys ['layout']). Both take it now, the one mapping
    (`args.RECIPE_ALIASES`), and refuse a recipe that gives both names, whose order chose before."""
    recipe = tmp_path / "r.yaml"
    for command, attr in (("bench", "spec"), ("plan", "sweep")):
        recipe.write_text(f"{command}:\n  models: [tiny]\n  layout: [full]\n")
        got = getattr(cli.parse_args([command, "--recipe", str(recipe)]), attr)
        assert (got.layouts if command == "bench" else got["layouts"]) == ("full",), got
        recipe.write_text(f"{command}:\n  models: [tiny]\n  layout: [full]\n  layouts: [engine]\n")
        err = _refused_recipe(command, recipe.read_text(), tmp_path, capsys)
        assert "'layout' and 'layouts' name the same key: give one of them" in err, err


@pytest.mark.parametrize("nccl, cuda, refused", [(False, False, "this torch has no NCCL built in"),
                                                  (True, False, "NCCL runs on GPUs and this machine has no CUDA device"),
                                                  (True, True, None)])
def test_demo_refuses_an_nccl_backend_this_machine_cannot_start(nccl, cuda, refused, capsys, monkeypatch):
    """``--backend nccl`` on a CPU-only torch was accepted; 12 s later every rank failed
    ("Distributed package doesn't have NCCL built in", a RankError traceback). ``cuda:gloo``, the
    NCCL-only group's emulation on CPU (`test_nccl_only_group`), is taken everywhere."""
    import torch.distributed as dist

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    for backend in ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl"):
        if refused is None:
            assert cli.parse_args(["demo", "--backend", backend]).opts.backend == backend
            continue
        with pytest.raises(SystemExit) as info:
            cli.parse_args(["demo", "--backend", backend])
        err = capsys.readouterr().err
        assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"argument --backend: {backend}: {refused}" in err and "cuda:gloo" in err, err
    assert cli.parse_args(["demo", "--backend", "cuda:gloo"]).opts.backend == "cuda:gloo"


BAD_RECIPES = [
    # each was a traceback (the YAML parser's, AttributeError, ZeroDivisionError, TypeError), a
    # header and then run_ranks' ValueError, or (warmup: -3) a run with no warm-up at all
    ("foo: [1, 2\n", ["--recipe", "not a YAML recipe: while parsing a flow sequence", "line 1, column 6"]),
    ("a: ${nope}\n", ["--recipe", "not a YAML recipe", "'nope' not found"]),
    ("- 1\n- 2\n", ["--recipe", "expected a mapping of keys (under 'bench:'), got a list"]),
    ("bench:\n  - models: tiny\n", ["--recipe", "expected a mapping of keys (under 'bench:'), got a list"]),
    ("bench:\n  models: tiny\n  tp: 0\n", ["--recipe", "bench key 'tp': expected a positive integer, got '0'"]),
    ("bench:\n  models: tiny\n  repeats: \"x\"\n", ["bench key 'repeats': expected a positive integer, got 'x'"]),
    ("bench:\n  models: tiny\n  ranks: 0\n", ["bench key 'ranks': expected a positive integer, got '0'"]),
    ("bench:\n  models: tiny\n  warmup: -3\n", ["bench key 'warmup': expected an integer >= 0, got '-3'"]),
    ("bench:\n  device: tpu\n", ["bench key 'device': expected one of cpu, cuda, got 'tpu'"]),
    ("bench:\n  bucket_mb: [4, -4]\n", ["bench key 'bucket_mb': expected a positive number, got '-4'"]),
]


def _refused_recipe(command: str, body: str, tmp_path, capsys) -> str:
    """``fsdp-sync COMMAND --recipe`` of a file holding ``body``: one line naming the recipe, exit 2."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(body)
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--recipe", str(recipe)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"fsdp-sync {command}: error: --recipe {recipe}: "), err
    return err


@pytest.mark.parametrize("body, words", BAD_RECIPES, ids=[b.replace("\n", " ").strip() for b, _ in BAD_RECIPES])
def test_a_bad_bench_recipe_is_one_line_and_exit_2(body, words, tmp_path, capsys, monkeypatch):
    from fsdp_sync.cli.bench import main as bench_main

    def started(*a, **k):
        raise AssertionError("bench started its ranks")

    monkeypatch.setattr(bench_main, "run_bench", started)
    err = _refused_recipe("bench", body, tmp_path, capsys)
    for w in words:
        assert w in err, (w, err)


@pytest.mark.timeout(200)
def test_demo_and_bench_take_layout_and_the_demo_shows_the_portable_checkpoint(tmp_path, capsys):
    """Issue 21 item 13: neither command had --layout, so the demo could not show the disk
    method's Hugging Face checkpoint (its default there is per-rank files)."""
    import json

    spec = cli.parse_args("bench --methods disk --layout full,engine".split()).spec
    assert spec.layouts == ("full", "engine") and spec.methods == ("disk",)
    assert cli.parse_args("demo --method disk --layout engine".split()).opts.layout == "engine"
    out = tmp_path / "demo.json"
    proc = cli_here(capsys, "demo", "--method", "disk", "--layout", "full", "--disk-dir", str(tmp_path / "ckpt"),
                    "--steps", "1", "--no-progress", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    step = json.loads(out.read_text())["steps"][-1]
    assert step["layout"] == "full"
    ck = step["checkpoint"]
    assert ck["path"] == str(tmp_path / "ckpt" / "step_0") and "Hugging Face" in ck["kind"]
    assert {"config.json", "model.safetensors.index.json"} <= set(ck["files"])
    assert (tmp_path / "ckpt" / "step_0" / "config.json").is_file()          # kept, as said
    text = " ".join(proc.stdout.split())
    assert "checkpoint of the last step:" in text and "kept" in text


def test_demo_runs_an_fp8_rollout_and_refuses_a_model_it_cannot_quantize(tmp_path, capsys):
    """Issue 25 item 1: ``--quantization fp8``; the engine is checked against the trainer's weights
    quantized the same way. A model whose TP split cuts a 128 block is refused before anything starts."""
    import json

    with pytest.raises(SystemExit):
        cli.parse_args("demo --quantization fp8 --model tiny".split())
    assert cli.parse_args("demo --quantization fp8 --model tiny-fp8".split()).opts.quantization == "fp8"
    assert cli.parse_args("demo --model tiny".split()).opts.quantization is None
    proc = cli_here(capsys, "demo", "--quantization", "fp8", "--model", "tiny-fp8", "--layout", "engine",
                    "--steps", "2", "--no-progress", "--json", str(tmp_path / "d.json"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "d.json").read_text())
    assert result["ok"] and result["config"]["quantization"] == "fp8"
    assert all(s["tokens_match"] and s["max_abs_logit_diff"] <= s["atol"] for s in result["steps"])
    assert "block FP8" in proc.stdout


BAD_MODEL = [    # (the change to a sound config.json, the words of the refusal)
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive integer, got 0"),
]


@pytest.mark.parametrize("command, flag", [("demo", "--model"), ("serve", "--model"), ("bench", "--models"),
                                           ("plan", "--models"), ("plan", "--config-json")])
def test_a_bad_model_config_is_one_line_for_every_command(command, flag, tmp_path, capsys):
    """A config.json no model can be built from was a ZeroDivisionError / RuntimeError /
    strict-dataclass traceback, or accepted (``demo`` with 0 layers reported ok)."""
    import json

    good = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    for i, (change, words) in enumerate(BAD_MODEL):
        path = tmp_path / f"m{i}.json"
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(SystemExit) as info:
            cli.parse_args([command, flag, str(path)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert flag in err and str(path) in err and words in err, (change, err)


def test_a_bad_cluster_file_is_one_line(tmp_path, capsys):
    """``plan --cluster FILE``: missing fields, not JSON, an unknown key, a number as text and a
    list were TypeError / JSONDecodeError / AttributeError tracebacks after the flags passed."""
    import json

    from fsdp_sync.cluster import CLUSTERS

    good = CLUSTERS["h100-node"].to_dict()
    for i, (body, words) in enumerate([
            (json.dumps({"name": "x", "device": "cuda"}), "cluster fields missing: ['gpus_per_node'"),
            ("not json", "not a cluster JSON file"),
            (json.dumps({**good, "bogus": 1}), "unknown cluster fields ['bogus']"),
            (json.dumps({**good, "memory_per_gpu": "80e9"}), "memory_per_gpu must be a finite number, got '80e9'"),
            (json.dumps([1, 2]), "expected a mapping of the fields of Cluster, got a list")]):
        path = tmp_path / f"c{i}.json"
        path.write_text(body)
        with pytest.raises(SystemExit) as info:
            cli.parse_args(["plan", "--models", "tiny", "--cluster", str(path)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert "--cluster" in err and str(path) in err and words in err, (body, err)


def test_plan_names_a_cpu_host_as_one_host(capsys):
    """``plan --cluster this-machine`` on a CPU host printed "1024 GPUs/node, 24 GiB each": the
    planner's no-limit placeholder and the host's RAM as if per GPU. Its saved cluster (device
    cpu) is one host, its cores and its RAM; a GPU cluster is still GPUs per node."""
    from fsdp_sync.cluster import load_cluster

    path = ROOT / "docs/data/cluster-this-machine.json"
    c = load_cluster(str(path))
    proc = cli_here(capsys, "plan", "--models", "tiny", "--cluster", str(path))
    head = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (f"on this-machine: one host, {c.cores} cores, {c.memory_per_gpu / 2**30:.0f} GiB RAM; d2d"
            in head and "GPUs/node" not in head and "GiB each" not in head), head
    proc = cli_here(capsys, "plan", "--models", "tiny", "--cluster", "h100-node")
    assert "on h100-node: 8 GPUs/node, 79 GiB each; d2d" in " ".join(proc.stdout.split()), proc.stdout


def test_faults_fleet_defaults_to_what_the_fleet_covers(tmp_path):
    args = cli.parse_args(["faults", "--fleet"])
    assert args.methods == ("distributed", "disk") and args.faults == ("kill", "stall")
    args = cli.parse_args(["faults", "--fleet", "--methods", "disk", "--faults", "stall"])
    assert args.methods == ("disk",) and args.faults == ("stall",)
    assert cli.parse_args(["faults"]).methods == ("tensor", "distributed", "disk")     # the matrix's own
    # an output under a folder still to be made is fine: the command makes it
    assert cli.parse_args(["faults", "--json", str(tmp_path / "new" / "f.json")]).json


def test_a_size_in_mib_is_refused_only_below_one_byte(capsys):
    """1e-7 MiB is 0 bytes (refused: it crashed after the ranks or the engine started); 1e-6 MiB
    is 1 byte, the smallest size taken."""
    assert cli.parse_args("demo --bucket-mb 0.000001".split()).opts.bucket_mb == 0.000001
    assert cli.parse_args("serve --max-body-mb 0.000001".split()).max_body_mb == 0.000001
    for argv in ("demo --bucket-mb 0.0000009", "serve --max-body-mb 0.0000009"):
        with pytest.raises(SystemExit):
            cli.parse_args(argv.split())
        assert "at least 1 byte" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_fp8_without_a_model_takes_the_recipe_whose_blocks_split(command, capsys):
    """`--quantization fp8` alone was refused (the default model, tiny, cuts its 128 blocks at
    every TP size): the default is tiny-fp8 then; a --model given is kept, and refused as before."""
    from fsdp_sync.cli import app as cli

    extra = ["--port", "0"] if command == "serve" else []
    assert cli.parse_args([command, "--quantization", "fp8", *extra]).model == "tiny-fp8"
    assert cli.parse_args([command, *extra]).model == "tiny"
    with pytest.raises(SystemExit):
        cli.parse_args([command, "--quantization", "fp8", "--model", "tiny", *extra])
    assert "is not a multiple of block 128" in capsys.readouterr().err


GPU_REFUSALS = [
    # one GPU per trainer rank whatever the method: both ranks went on cuda:0 and NCCL refused the
    # FSDP group after the model was built (only --method distributed was checked)
    ("demo --device cuda --ranks 2 --tp 1", 1, ["--device cuda --ranks 2 needs 2 GPUs", "has 1"]),
    ("demo --device cuda --ranks 2 --tp 1 --method disk", 1, ["--ranks 2 needs 2 GPUs", "has 1"]),
    ("bench --device cuda --ranks 2 --tp 1", 1, ["--device cuda --ranks 2 needs 2 GPUs", "has 1"]),
    # bench's distributed rows: the engine on GPUs of its own, checked per (method, ranks, tp)
    ("bench --device cuda --methods tensor,distributed --ranks 1,2 --tp 1", 2,
     ["--methods distributed --device cuda needs --ranks + --tp = 3 GPUs", "has 2"]),
]


@pytest.mark.parametrize("argv, gpus, words", GPU_REFUSALS, ids=[a for a, _, _ in GPU_REFUSALS])
def test_a_cuda_job_the_gpus_cannot_hold_is_one_line_up_front(argv, gpus, words, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv.split())
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("argv, gpus", [("bench --device cuda --ranks 1 --tp 1", 1),
                                        ("bench --device cuda --methods tensor,distributed --ranks 1 --tp 1", 2),
                                        ("bench --device cuda --ranks 2 --tp 1,2", 2)])
def test_a_cuda_bench_the_gpus_hold_is_taken(argv, gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert cli.parse_args(argv.split()).spec.device == "cuda"


@pytest.mark.parametrize("body", ["foo: [1, 2\n", "- 1\n- 2\n"])
def test_a_plan_recipe_yaml_cannot_read_is_one_line_and_exit_2(body, tmp_path, capsys):
    """The plan's --recipe loaded with OmegaConf unguarded: a YAML parser traceback, exit 1."""
    _refused_recipe("plan", body, tmp_path, capsys)


def test_the_targets_recipe_is_the_targets_preset():
    """recipes/memory_tuning/targets.yaml said it was `--preset targets` but lacked its
    share_host_memory, layouts and pipelined keys: 2 rows where the preset runs the whole sweep."""
    from importlib import resources

    from fsdp_sync.cli.args import recipe_mapping
    from fsdp_sync.cli.bench.main import PRESETS

    path = resources.files("fsdp_sync") / "recipes" / "memory_tuning" / "targets.yaml"
    recipe = recipe_mapping(str(path), "bench")
    assert recipe.pop("device") == "cpu"
    assert recipe == PRESETS["targets"]
