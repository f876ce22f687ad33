"""Random-weight model directories at real geometries, for SGLang's ``--load-format dummy``.

No weight files: a config.json and the embedded model's tokenizer (SmolLM2's, vocabulary 49,152),
which is all SGLang needs to build the model and fill it with random weights. For speed at the
geometries that matter, not for answers.

  llama3-8b-class   LlamaForCausalLM, 32 layers, 32q/8kv heads of 128, context raised to 128K
  qwen3.6-27b-class the hybrid of Qwen3.6-27B: 64 layers, every 4th full attention (16 layers of
                    24q/4kv/256, gated, partial RoPE), the rest Gated DeltaNet, dense MLP
                    (SGLang's Qwen3_5ForCausalLM). Only full-attention KV is tiered.

  PYTHONPATH=test python3 -m minima_test_support.dummy_models /tmp/models   # one directory per line
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json")

GEOMETRIES: dict[str, dict] = {
    "llama3-8b-class": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False,
    },
    "qwen3.6-27b-class": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
        "full_attention_interval": 4, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        # Qwen3.5 checkpoints give RoPE as rope_parameters; an empty one is refused by get_rope
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
        "hidden_act": "silu", "tie_word_embeddings": False,
    },
}


def serve_flags(model: Path) -> list[str]:
    """The flags the device e2e geometry test (test/e2e/test_geometries.py) serves a dummy model with
    (scripts/device/geometry_start.py starts one the same way)."""
    return ["--model-path", str(model), "--load-format", "dummy", "--context-length", "32768",
            "--max-total-tokens", "65536", "--max-running-requests", "4"]


def make_model(name: str, root: Path, tokenizer_dir: Path) -> Path:
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    config = {**GEOMETRIES[name], "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, out / f)
    return out


def main() -> None:
    from sglang_minima.models import ensure_default_model

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/models")
    tokenizer_dir = ensure_default_model()
    for name in GEOMETRIES:
        print(make_model(name, root, tokenizer_dir))


if __name__ == "__main__":
    main()
