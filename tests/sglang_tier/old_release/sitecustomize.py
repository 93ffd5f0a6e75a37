"""Lets an older SGLang (0.5.12) import on the tier's CPU torch: on ``PYTHONPATH`` only in
`make test-sglang`'s runs against older releases (Python imports ``sitecustomize`` at start, in
the tests' subprocesses too; it shadows a system ``sitecustomize`` there).

0.5.12's ``sglang.srt.utils.common`` (0.5.20's and 0.5.21's too), which ``import sglang`` itself
reaches, does ``from torchvision.io import decode_jpeg`` at module level (0.5.23 does not). torchvision's PyPI wheels are
CUDA builds that do not load beside the CPU torch, so the tier has none. This finder serves a
stand-in ``torchvision`` / ``torchvision.io`` (``decode_jpeg`` raises if called: image decoding is
not what the tier runs) only while that one module is being imported, and takes the stand-in out
of ``sys.modules`` at the next import after it: transformers and everything else still see no
torchvision (a stand-in they could see would make transformers import ``torchvision.io`` names
the stand-in lacks).
"""

import importlib.abc
import importlib.machinery
import sys

_NAMES = ("torchvision", "torchvision.io")
_IMPORTER = "sglang.srt.utils.common"


def _decode_jpeg(*args, **kwargs):
    raise RuntimeError("torchvision is not installed in the SGLang tier (CPU torch); "
                       "sglang 0.5.12 got a stand-in decode_jpeg only so that it imports")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        importer = sys.modules.get(_IMPORTER)
        spec = getattr(importer, "__spec__", None)
        if importer is None or not getattr(spec, "_initializing", False):
            for n in _NAMES:     # the importer is done (or never came): the stand-in goes
                if getattr(sys.modules.get(n), "__fsdp_sync_stand_in__", False):
                    del sys.modules[n]
            return None
        if name in _NAMES:
            return importlib.machinery.ModuleSpec(name, self, is_package=name == "torchvision")
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__fsdp_sync_stand_in__ = True
        if module.__name__ == "torchvision.io":
            module.decode_jpeg = _decode_jpeg


sys.meta_path.insert(0, _TorchvisionStandIn())
