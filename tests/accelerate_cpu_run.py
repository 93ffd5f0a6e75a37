"""TEST-ONLY: ``accelerate launch ... tests/accelerate_cpu_run.py SCRIPT ARGS``: run SCRIPT with
accelerate made to shard on CPU (`accelerate_cpu.patch_accelerator`). On a GPU run SCRIPT itself."""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_cpu import patch_accelerator  # noqa: E402

if __name__ == "__main__":
    patch_accelerator()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
