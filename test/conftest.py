import os

# SGLang's CPU engine and the pure-torch sgl_kernel stand-in must be set up before anything
# imports sglang; tests that touch SGLang classes in-process need the same setup as the launcher.
from sglang_minima.cpu_engine import setup_cpu_engine

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False

if not _has_cuda and "sglang" not in __import__("sys").modules:
    setup_cpu_engine()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import pytest

    if _has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not the folder name: compile-only tests run here
            item.add_marker(skip)
