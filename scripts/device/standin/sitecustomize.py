"""Device-harness patches applied as SGLang modules import (the stand-in's directory is on PYTHONPATH).

SGLang's DualGemm picks its mode through the CUTLASS DSL, which the harness does not bring (95 MB):
it is turned off, so the layers that would use it take their plain GEMM path.
"""

import importlib.abc
import importlib.util
import sys


def _no_dual_gemm(module) -> None:
    module.DualGemm._select_mode = lambda self, *args, **kwargs: None


_PATCHES = {"sglang.srt.layers.dual_gemm": _no_dual_gemm}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module, _exec=exec_module, _name=name):
            _exec(module)
            _PATCHES[_name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
