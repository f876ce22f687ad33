"""Capture real K/V (and the last token's query) of SmolLM2-135M-Instruct for the GPU kernel tests.

The device machine cannot run the model, so the capture runs here on CPU and the tensors travel with
the repo (test/gpu/data/smollm2_qkv.pt, ~2.4 MB): three layers, the first 1,024 tokens of RULER's
Paul Graham essays haystack, post-RoPE q/k and v in fp16.

    python test/gpu/capture_smollm2_kv.py --text /path/to/paul_graham_essays.txt
    (text: /work/shared/recipes/models/setup_text.sh; model: sglang_minima.models.ensure_default_model)
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
LAYERS = (1, 15, 29)
TOKENS = 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "smollm2_qkv.pt")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmark" / "codec"))
    from capture import capture_qkv
    from sglang_minima.models import ensure_default_model

    layers = capture_qkv(Path(ensure_default_model()), args.text.read_text(), TOKENS, list(LAYERS))
    torch.save(
        {
            "model": "SmolLM2-135M-Instruct",
            "text": args.text.name,
            "layers": {
                c.layer_id: {
                    "q_last": c.q[-1].to(torch.float16),  # [Hq, D]
                    "k": c.k.to(torch.float16),  # [N, H, D]
                    "v": c.v.to(torch.float16),
                    "sm_scale": c.sm_scale,
                }
                for c in layers
            },
        },
        args.out,
    )
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
