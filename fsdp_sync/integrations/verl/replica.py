"""verl's rollout on fsdp_sync's reference engine: ``actor_rollout_ref.rollout.name=fsdp_sync_ref``.

A verl rollout is a *replica* (``verl.workers.rollout.replica.RolloutReplica``) whose Ray *server
actor* generates for the agent loop and whose worker-side *adapter* receives the weights. Under
the name `ROLLOUT_NAME` (registered by the plug-in, ``fsdp_sync.integrations.verl``; verl's own
``"sglang"`` is left alone) both are fsdp_sync's:

- `ServeReplica` starts one `ServeServer` actor per replica node, named
  ``fsdp_sync_server_{replica}_{node}`` (`server_name`);
- `ServeServer` runs ``fsdp-sync serve`` as a child process: the model's ``config.json`` from verl's
  model path, ``--tp`` from ``rollout.tensor_model_parallel_size``, ``--dtype`` from
  ``rollout.dtype``, a free port on 127.0.0.1 (read from serve's first line, never from an
  environment variable). The child is tied to the actor: it gets SIGTERM when the actor's process
  dies (``PR_SET_PDEATHSIG``) and is stopped by `ServeServer.shutdown` and at the actor's exit, so
  ``ray.shutdown()`` leaves no serve or engine worker behind. Its output goes to
  ``fsdp_sync_serve_{replica}_{node}.log`` under ``rollout.custom.fsdp_sync.log_dir`` (default:
  the system temp directory; the path is logged);
- generation: verl's ``generate(prompt_ids, sampling_params, request_id, ...)`` becomes one
  ``POST /generate``: ``max_tokens``/``max_new_tokens`` as verl's SGLang server reads them (capped
  by ``response_length`` and the context), ``logprobs`` -> ``return_logprob`` (so
  ``rollout.calculate_log_probs=True``, verl's default for rollout correction, gets
  ``output_token_logprobs``), every other sampling key passed on; a key serve cannot honour is
  refused by serve naming it (HTTP 400), never dropped. Images and video are refused;
- LoRA served as an adapter (``lora_rank`` > 0, ``lora.merge=false``; `verl_lora`): every request
  carries ``lora_path`` = verl's adapter name, and ``sleep``/``wake_up`` release and resume the KV
  cache only, keeping the base weights synced once, as verl's SGLang server does;
- memory: ``sleep``/``wake_up``/``release_kv_cache``/``resume_kv_cache`` are the same release and
  resume calls verl's SGLang server makes (only when ``free_cache_engine``);
  ``abort_all_requests`` is ``/abort_request {"abort_all": true}`` and holds new requests in the
  actor (or refuses them, ``reject_request``) until ``resume_generation``, as SGLang's
  ``pause_generation(mode="abort")`` does; it returns once every request posted before the gate
  closed has been answered (aborted again while any is out: one on the wire when the abort
  landed would otherwise run through the sync).

CPU runs only (``VERL_PLATFORM=cpu``, `cpu_platform`): serve runs on CPU (no ``--device``) in an
actor that asks Ray for no GPU, while on a GPU host verl's trainer tensors are CUDA tensors, which
reach serve as CUDA IPC handles a CPU server cannot open. `ServeReplica.launch_servers` therefore
refuses, before any actor starts, wherever verl's device is not ``cpu`` (`check_device`), naming
what to use there: ``rollout.name=sglang`` with fsdp_sync's adapter. Serving on the replica's GPUs
(``--device cuda``, the actor placed on them) is not built: it has never run on a GPU.

The adapter (`adapter.SGLangAdapter`, always on under this name) finds this actor by
`server_name` and syncs into serve over HTTP.

Not here: the CPU platform (`cpu_platform`), the sync (`adapter`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import ray
from verl.utils import device as verl_device
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from ...config import parse_dtype
from ...engines.sglang.client import HttpClient
from .. import verl_lora

__all__ = ["ROLLOUT_NAME", "ServeReplica", "ServeServer", "server_name", "serve_command",
           "sampling_request", "check_device"]

ROLLOUT_NAME = "fsdp_sync_ref"
START_TIMEOUT_S = 300.0
ABORT_WAIT_S = 600.0       # abort_all_requests waits this long for the requests it aborts
_URL = re.compile(r" on (http://\S+) ")

log = logging.getLogger("fsdp_sync.verl")


def server_name(replica_rank: int, node_rank: int, suffix: str = "") -> str:
    """The Ray name of a replica node's server actor (the adapter looks it up by this name)."""
    return f"fsdp_sync_server_{replica_rank}_{node_rank}{suffix}"


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if isinstance(node, dict):
        return node.get(key, default)
    return getattr(node, key, default)


def _model_config_json(model_config: Any) -> str:
    path = _get(model_config, "local_path") or _get(model_config, "path")
    if not path:
        raise ValueError("rollout.name=fsdp_sync_ref needs actor_rollout_ref.model.path (a Hugging "
                         "Face model directory with a config.json)")
    path = os.path.expanduser(str(path))
    cfg = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"rollout.name=fsdp_sync_ref: no config.json at {cfg} (from "
                                f"actor_rollout_ref.model.path={path!r}); the reference engine "
                                f"builds the model from it")
    return cfg


def check_device() -> None:
    """Refuse a run whose trainer is not on CPU (see the module docstring): ``fsdp-sync serve``
    here runs on CPU and cannot open the CUDA IPC handles of a GPU trainer's tensors."""
    device = verl_device.get_device_name()
    if device != "cpu":
        raise ValueError(
            f"rollout.name={ROLLOUT_NAME} runs fsdp_sync's reference engine on CPU (fsdp-sync serve, "
            f"a Ray actor with no GPU) and takes the weights as handles of the trainer's tensors, "
            f"but verl runs on {device!r} here, whose tensor handles a CPU server cannot open: "
            f"on GPUs use actor_rollout_ref.rollout.name=sglang with "
            f"+actor_rollout_ref.rollout.custom.fsdp_sync.enable=true (fsdp_sync's adapter over "
            f"SGLang, docs/verl.md); {ROLLOUT_NAME} is for CPU runs (VERL_PLATFORM=cpu, "
            f"recipes/verl/run_tiny_grpo_cpu.sh)")


def serve_command(config: Any, model_config: Any) -> list[str]:
    """The ``fsdp-sync serve`` command line of one replica (see the module docstring); every
    setting it cannot honour is refused here, naming verl's key."""
    dp = int(_get(config, "data_parallel_size", 1) or 1)
    pp = int(_get(config, "pipeline_model_parallel_size", 1) or 1)
    if dp != 1 or pp != 1:
        raise ValueError(f"rollout.name=fsdp_sync_ref serves with tensor parallelism only: "
                         f"rollout.data_parallel_size={dp} and pipeline_model_parallel_size={pp} "
                         f"must be 1 (use more replicas instead)")
    tp = int(_get(config, "tensor_model_parallel_size", 1) or 1)
    raw = _get(config, "dtype", "bfloat16")
    try:     # SGLang's spellings too (half, float; auto: as SGLang reads the model's config)
        dtype = str(parse_dtype(raw, "rollout.dtype", hf_config=_get(model_config, "hf_config", None)))
        if raw is None:
            raise ValueError("null is no dtype the engine can serve")
    except ValueError as exc:
        raise ValueError(f"rollout.dtype={raw!r}: the reference engine serves float32, bfloat16 or "
                         f"float16 ({exc})") from None
    dtype = dtype.removeprefix("torch.")
    quant = _get(config, "quantization", None)
    if quant not in (None, "fp8"):
        raise ValueError(f"rollout.quantization={quant!r}: the reference engine serves block FP8 "
                         f"('fp8') or the rollout dtype (null)")
    return [sys.executable, "-m", "fsdp_sync.cli", "serve", "--model",
            _model_config_json(model_config), "--tp", str(tp), "--dtype", dtype,
            "--host", "127.0.0.1", "--port", "0", *(["--quantization", quant] if quant else [])]


def sampling_request(prompt_ids: Any, sampling_params: dict, request_id: str, config: Any, *,
                     image_data: Any = None, video_data: Any = None) -> dict:
    """verl's generate arguments as serve's ``/generate`` body (see the module docstring)."""
    if image_data is not None or video_data is not None:
        raise ValueError("rollout.name=fsdp_sync_ref generates from token ids only: image_data "
                         "and video_data are not supported")
    ids = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
    sp = dict(sampling_params)
    response_length = int(_get(config, "response_length"))
    prompt_length = int(_get(config, "prompt_length"))
    max_model_len = _get(config, "max_model_len") or (prompt_length + response_length)
    room = int(max_model_len) - len(ids) - 1
    if room < 0:
        raise ValueError(f"prompt of {len(ids)} tokens exceeds the context length "
                         f"{max_model_len} (rollout.max_model_len)")
    if "max_new_tokens" in sp:
        max_new = sp.pop("max_new_tokens")
    elif "max_tokens" in sp:
        max_new = sp.pop("max_tokens")
    else:
        max_new = min(response_length, prompt_length + response_length - len(ids))
    sp["max_new_tokens"] = max(0, min(int(max_new), room))
    return_logprob = bool(sp.pop("logprobs", False))
    if sp.pop("prompt_logprobs", None) is not None:
        raise ValueError("rollout.name=fsdp_sync_ref does not return prompt log-probs "
                         "(prompt_logprobs)")
    return {"rid": str(request_id), "input_ids": ids, "sampling_params": sp,
            "return_logprob": return_logprob}


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServeServer:
    """One replica node's server actor: ``fsdp-sync serve`` as a child (see the module docstring)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int, node_rank: int,
                 log_dir: str | None = None) -> None:
        self.config = config
        self.replica_rank, self.node_rank = replica_rank, node_rank
        self.command = serve_command(config, model_config)
        self.lora_as_adapter = verl_lora.served_as_adapter(model_config)
        self.log_path = os.path.join(log_dir or tempfile.gettempdir(),
                                     f"fsdp_sync_serve_{replica_rank}_{node_rank}.log")
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.http: HttpClient | None = None
        self.global_steps: int | None = None
        self._open = asyncio.Event()          # cleared between abort_all_requests and resume
        self._open.set()
        self._reject = False
        self._posted = 0        # /generate requests past the gate and not answered yet

    # ------------------------------------------------------------------ lifetime
    async def launch_server(self) -> str:
        if self.proc is not None:
            return self.url
        # serve writes straight to its log (nothing to drain, nothing lost when the actor goes);
        # started from the actor's event-loop thread, which lives as long as the actor (the death
        # signal fires when the *thread* that forked exits)
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.url = await asyncio.to_thread(self._read_url)
        self.http = HttpClient(self.url, api_key=None, timeout_s=600.0, max_retries=0,
                               backoff_s=0.1, backoff_max_s=1.0, proxies=None)
        log.info("fsdp_sync_ref replica %d node %d: %s (log %s)", self.replica_rank,
                 self.node_rank, self.url, self.log_path)
        return self.url

    def _read_url(self) -> str:
        """serve's URL, from the line it prints once it listens."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            with open(self.log_path) as f:
                m = _URL.search(f.read())
            if m:
                return m.group(1)
            time.sleep(0.1)
        rc = self.proc.poll()
        self.shutdown()
        with open(self.log_path) as f:
            out = f.read()[-3000:]
        why = f"exit code {rc}" if rc is not None else f"no URL within {START_TIMEOUT_S:.0f} s"
        raise RuntimeError(f"fsdp-sync serve for replica {self.replica_rank} did not start "
                           f"({why}): {' '.join(self.command)}\n{out}")

    def shutdown(self, timeout_s: float = 30.0) -> int | None:
        """Stop serve (SIGTERM, then SIGKILL after ``timeout_s``); its exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode

    def __del__(self) -> None:
        if getattr(self, "proc", None) is not None:
            self.shutdown(timeout_s=5.0)

    def get_server_address(self) -> tuple[str, int]:
        host, port = self.url.split("://", 1)[1].rsplit(":", 1)
        return host, int(port)

    def get_log_path(self) -> str:
        return self.log_path

    # ------------------------------------------------------------------ calls
    async def _post(self, path: str, body: dict) -> Any:
        if self.http is None:
            raise RuntimeError("fsdp_sync_ref: the server has not been launched")
        try:
            return await asyncio.to_thread(self.http.json, "POST", path, body)
        except Exception as exc:
            # serve gone (killed, out of memory): said so, with its exit code and log, not as a
            # connection error to a URL
            rc = self.proc.poll() if self.proc is not None else None
            if rc is None:
                raise
            raise RuntimeError(f"fsdp_sync_ref replica {self.replica_rank} node {self.node_rank}: "
                               f"its fsdp-sync serve (pid {self.proc.pid}) exited with code {rc}, "
                               f"so {path} failed ({type(exc).__name__}: {exc}); see its log "
                               f"{self.log_path}") from exc

    async def generate(self, prompt_ids: Any, sampling_params: dict, request_id: str,
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> TokenOutput:
        body = sampling_request(prompt_ids, sampling_params, request_id, self.config,
                                image_data=image_data, video_data=video_data)
        if self.lora_as_adapter:
            body["lora_path"] = verl_lora.LORA_NAME
        if not self._open.is_set():
            if self._reject:
                raise RuntimeError(f"fsdp_sync_ref replica {self.replica_rank} is paused "
                                   f"(abort_all_requests(reject_request=True)); request "
                                   f"{request_id} refused")
            await self._open.wait()           # held until resume_generation, as SGLang holds it
        self._posted += 1
        try:
            out = await self._post("/generate", body)
        finally:
            self._posted -= 1
        meta = out.get("meta_info") or {}
        ids = [int(t) for t in out.get("output_ids") or []]
        log_probs = None
        if body["return_logprob"]:
            pairs = meta.get("output_token_logprobs") or []
            if len(pairs) != len(ids):
                raise RuntimeError(f"serve answered {len(pairs)} log-probs for {len(ids)} tokens "
                                   f"(request {request_id})")
            log_probs = [float(p[0]) for p in pairs]
        finish = meta.get("finish_reason") or {}
        return TokenOutput(token_ids=ids, log_probs=log_probs,
                           stop_reason="aborted" if finish.get("type") == "abort" else "completed",
                           extra_fields={"global_steps": self.global_steps})

    async def _memory(self, path: str, tags: list[str]) -> None:
        if self.node_rank == 0 and self.config.free_cache_engine:
            await self._post(path, {"tags": tags})

    async def wake_up(self) -> None:
        await self._memory("/resume_memory_occupation", self._tags())

    async def sleep(self) -> None:
        await self._memory("/release_memory_occupation", self._tags())

    def _tags(self) -> list[str]:
        return ["kv_cache"] if self.lora_as_adapter else ["kv_cache", "weights"]

    async def clear_kv_cache(self) -> None:
        if self.node_rank == 0:
            await self._post("/flush_cache", {})

    async def release_kv_cache(self) -> None:
        await self._memory("/release_memory_occupation", ["kv_cache"])

    async def resume_kv_cache(self) -> None:
        await self._memory("/resume_memory_occupation", ["kv_cache"])

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Abort what runs and hold what comes (or refuse it, ``reject_request``) until
        `resume_generation`: SGLang's ``pause_generation(mode="abort")``."""
        self._reject = bool(reject_request)
        self._open.clear()
        if self.node_rank != 0:
            return
        await self._post("/abort_request", {"abort_all": True})
        # a request posted just before the gate closed may reach serve after the abort (the two
        # travel on separate connections) and then run through the weight sync that follows:
        # aborted again until every request past the gate has been answered, as SGLang's
        # pause_generation returns only once nothing runs
        deadline = time.monotonic() + ABORT_WAIT_S
        while self._posted:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fsdp_sync_ref replica {self.replica_rank}: {self._posted} "
                                   f"request(s) still unanswered {ABORT_WAIT_S:.0f} s after "
                                   f"abort_all_requests; serve's log: {self.log_path}")
            await asyncio.sleep(0.05)
            await self._post("/abort_request", {"abort_all": True})

    async def resume_generation(self) -> None:
        self._reject = False
        self._open.set()

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class ServeReplica(RolloutReplica):
    """verl's replica for `ROLLOUT_NAME`: one `ServeServer` actor per node (see the module docstring)."""

    async def launch_servers(self) -> None:
        check_device()          # before any actor starts: a GPU host cannot run this rollout
        opts = _get(_get(self.config, "custom"), "fsdp_sync") or {}
        log_dir = _get(opts, "log_dir")
        actor = ray.remote(ServeServer)
        if self.nnodes != 1:
            raise ValueError(f"rollout.name=fsdp_sync_ref serves one replica from one machine: "
                             f"tensor_model_parallel_size={self.world_size} spans {self.nnodes} "
                             f"nodes of trainer.n_gpus_per_node={self.gpus_per_node}")
        self.servers = []
        for node_rank in range(self.nnodes):
            self.servers.append(actor.options(
                name=server_name(self.replica_rank, node_rank, self.name_suffix), num_cpus=0,
                max_concurrency=self.max_concurrency,
            ).remote(self.config, self.model_config, self.replica_rank, node_rank, log_dir))
        await asyncio.gather(*[s.launch_server.remote() for s in self.servers])
        host, port = await self.servers[0].get_server_address.remote()
        self._server_handle = self.servers[0]
        self._server_address = f"{host}:{port}"
