"""Device-harness stand-in for ``sgl_kernel`` (sglang-kernel 0.4.10), in torch.

sglang-kernel's compiled ops do not load on the device image's torch 2.11 (ABI), and the wheel
cannot be carried there. SGLang's Python calls only a handful of them for a Llama/Qwen-class model:
those are written here in torch (CUDA-graph capturable, no host syncs). Every other name imports
as a placeholder that raises NotImplementedError naming itself when called, so a path that needs
a missing op fails loudly, never silently. Norm and activation run slower than sglang-kernel's
fused kernels; every arm of a harness comparison runs this same stand-in, and each figure says so.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch
import torch.nn.functional as F

__version__ = "0.4.10"  # SGLang asserts sglang-kernel >= 0.4.9 at start


class _Missing:
    """A name sglang-kernel has and this stand-in does not: raises when called, naming itself."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in (device harness): {self._name} is not available")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in: missing {self._name}>"


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if gemma else weight.float()
    return (y * w).to(x.dtype)


def _out(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return _out(_rms(input, weight, eps), out)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return _out(_rms(input, weight, eps, gemma=True), out)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, gemma=True))


def _gated(act, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    d = input.shape[-1] // 2
    return _out(act(input[..., :d]) * input[..., d:], out)


def silu_and_mul(input, out=None):
    return _gated(F.silu, input, out)


def gelu_and_mul(input, out=None):
    return _gated(F.gelu, input, out)


def gelu_tanh_and_mul(input, out=None):
    return _gated(lambda t: F.gelu(t, approximate="tanh"), input, out)


def weak_ref_tensor(t):
    return t  # a strong reference: keeps the buffer alive, no aliasing change


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)


class _Submodule(types.ModuleType):
    """``sgl_kernel.<anything>``: every attribute is a placeholder (PDL reported unsupported)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "is_arch_support_pdl":
            return lambda: False
        return _Missing(f"{self.__name__}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Submodule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _SubmoduleFinder())
