"""`engine_args.check_engine_args`: each `ReferenceEngine` argument refused naming it, the rule and
the value (no worker starts), and the edges of each rule taken. In-process, no engine started."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.reference.engine_args import check_engine_args

pytestmark = pytest.mark.timeout(60)

_ARGS = set(inspect.signature(check_engine_args).parameters)
DEFAULTS = {k: p.default for k, p in inspect.signature(ReferenceEngine.__init__).parameters.items() if k in _ARGS}


def check(**kw):
    return check_engine_args(**{**DEFAULTS, **kw})


def test_the_defaults_are_taken():
    a = check()
    assert (a.dtype, a.device, a.tp_size, a.kv_cache_tokens, a.num_threads) == (torch.float32, "cpu", 1, 4096, 1)


@pytest.mark.parametrize("kw,message", [
    ({"kv_cache_tokens": 64, "mem_fraction": 0.5}, r"give kv_cache_tokens or mem_fraction, not both .*64.*0\.5"),
    ({"mem_fraction": 1.5}, r"mem_fraction must be in \(0, 1\], got 1.5"),
    ({"mem_fraction": 0}, r"mem_fraction must be in \(0, 1\], got 0"),
    ({"mem_fraction": True}, r"mem_fraction must be in \(0, 1\], got True"),
    ({"seed": 2 ** 64}, r"seed must be an int in \[-2\*\*63, 2\*\*64 - 1\] .*got 18446744073709551616"),
    ({"seed": -(2 ** 63) - 1}, r"seed must be an int .*got -9223372036854775809"),
    ({"seed": True}, r"seed must be an int .*got True"),
    ({"keep_bucket_buffers": "no"}, "keep_bucket_buffers must be True or False, got 'no'"),
    ({"use_memory_saver": 0}, "use_memory_saver must be True or False, got 0"),
    ({"pg_timeout_s": 0}, "pg_timeout_s must be a finite number of seconds > 0, got 0"),
    ({"startup_timeout_s": math.inf}, "startup_timeout_s must be a finite number of seconds > 0, got inf"),
    ({"call_timeout_s": -1}, r"call_timeout_s must be a finite number of seconds > 0 \(or None to wait"),
    ({"num_threads": 0}, r"num_threads must be an int >= 1 \(or None for 1\), got 0"),
    ({"tp_size": 0}, "tp_size must be an int >= 1, got 0"),
    ({"tp_size": 2.0}, "tp_size must be an int >= 1, got 2.0"),
    ({"base_gpu_id": -1}, "base_gpu_id must be an int >= 0, got -1"),
    ({"device": "cuda:0"}, "device must be 'cpu' or 'cuda', got 'cuda:0'"),
    ({"dtype": torch.int8}, r"dtype must be one of .*got torch.int8"),
    ({"dtype": "fp8"}, r"dtype must be one of .*got 'fp8'"),
])
def test_an_argument_out_of_its_rule_is_refused_naming_it(kw, message):
    with pytest.raises(ValueError, match=message):
        check(**kw)


def test_the_engine_refuses_before_any_worker_starts():
    with pytest.raises(ValueError, match="give kv_cache_tokens or mem_fraction, not both"):
        ReferenceEngine("tiny", kv_cache_tokens=64, mem_fraction=0.5)
    with pytest.raises(ValueError, match="seed must be an int"):
        ReferenceEngine("tiny", seed=2 ** 64)


def test_the_edges_of_each_rule_are_taken():
    assert check(mem_fraction=1).mem_fraction == 1.0 and check(mem_fraction=1).kv_cache_tokens is None
    assert check(seed=2 ** 64 - 1).seed == 2 ** 64 - 1 and check(seed=-(2 ** 63)).seed == -(2 ** 63)
    assert check(kv_cache_tokens=1).kv_cache_tokens == 1
    assert check(call_timeout_s=None).call_timeout_s is None
    assert check(dtype="bf16").dtype == torch.bfloat16 and check(dtype="float16").dtype == torch.float16
    assert check(num_threads=3).num_threads == 3 and check(max_lora_rank=None).max_lora_rank is None
