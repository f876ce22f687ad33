"""Real post-RoPE Q and K, and V, from a Hugging Face Llama-family model on real text (forward hooks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class LayerQKV:
    layer_id: int
    q: torch.Tensor  # fp32 [N, Hq, D], post-RoPE
    k: torch.Tensor  # fp32 [N, H, D], post-RoPE (what the KV cache stores)
    v: torch.Tensor  # fp32 [N, H, D]
    sm_scale: float


def capture_qkv(model_dir: Path, text: str, num_tokens: int, layers: list[int]) -> list[LayerQKV]:
    """Run one forward pass over the first num_tokens tokens of text and capture the given layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(text, return_tensors="pt").input_ids[:, :num_tokens]
    if ids.shape[1] < num_tokens:
        raise ValueError(f"text has only {ids.shape[1]} tokens, need {num_tokens}")
    captured: list[LayerQKV] = []

    def hook(module, args, kwargs, output):
        # Recompute the projections exactly as LlamaAttention.forward does, keeping post-RoPE q, k.
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        q = module.q_proj(hidden).view(shape).transpose(1, 2)
        k = module.k_proj(hidden).view(shape).transpose(1, 2)
        v = module.v_proj(hidden).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        captured.append(
            LayerQKV(
                module.layer_idx,
                q[0].transpose(0, 1).clone(),
                k[0].transpose(0, 1).clone(),
                v[0].transpose(0, 1).clone(),
                float(module.scaling),
            )
        )

    handles = [model.model.layers[i].self_attn.register_forward_hook(hook, with_kwargs=True) for i in layers]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return sorted(captured, key=lambda c: c.layer_id)
