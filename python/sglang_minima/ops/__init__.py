"""Reference attention ops (torch, tensors in, (out, base-2 LSE) out), and the small device helpers
the planners and kernels share (scratch accounting, host_copy). No sglang import."""

from .dense import attend, causal_mask
from .merge import merge_attention_states
from .paged import HotPagedKV, Tq3PagedKV, hot_paged_attention, mixed_paged_attention, tq3_paged_attention

__all__ = [
    "HotPagedKV",
    "Tq3PagedKV",
    "attend",
    "causal_mask",
    "hot_paged_attention",
    "merge_attention_states",
    "mixed_paged_attention",
    "tq3_paged_attention",
]
