"""The hooks that bring Minima's pool, allocator, cell size and radix cache into SGLang."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.registry import get_radix_cache_factory
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.config import CONFIG_ENV, MinimaConfig
from sglang_minima.mem_cache.allocator import MinimaPagedAllocator
from sglang_minima.hooks import (
    cell_size_hook,
    fused_kv_write_hook,
    install_memory_hooks,
    kv_pool_cls_hook,
    minima_radix_cache_factory,
    paged_allocator_cls_hook,
    validate_prompt_ids_hook,
)
from sglang_minima.mem_cache.kv_pool import MinimaKVPool
from sglang_minima.mem_cache.tier_store import minima_cell_size


def _select(monkeypatch, config: MinimaConfig | None) -> None:
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=64))
    if config is None:
        monkeypatch.delenv(CONFIG_ENV, raising=False)
    else:
        monkeypatch.setenv(CONFIG_ENV, config.to_json())


def test_install_registers_backend_and_hooks_once():
    install_memory_hooks()
    install_memory_hooks()
    assert get_radix_cache_factory("minima") is minima_radix_cache_factory
    targets = {t for t in HookRegistry._hooks if t.startswith("sglang.srt.platforms.interface.SRTPlatform")}
    assert targets == {
        "sglang.srt.platforms.interface.SRTPlatform.get_kv_pool_cls",
        "sglang.srt.platforms.interface.SRTPlatform.get_paged_allocator_cls",
    }
    own = [h for t, hooks in HookRegistry._hooks.items() for _, h, _ in hooks if h is kv_pool_cls_hook]
    assert len(own) == 1


def test_pool_and_allocator_classes_only_when_selected(monkeypatch):
    original = lambda platform, **kw: None  # noqa: E731  (the in-tree default)
    _select(monkeypatch, None)
    assert kv_pool_cls_hook(original, object(), kind="mha") is None
    assert paged_allocator_cls_hook(original, object()) is None
    _select(monkeypatch, MinimaConfig())
    assert kv_pool_cls_hook(original, object(), kind="mha") is MinimaKVPool
    assert kv_pool_cls_hook(original, object(), kind="mla") is None
    assert paged_allocator_cls_hook(original, object()) is MinimaPagedAllocator


def test_prompt_check_refuses_what_would_kill_the_scheduler_only_when_selected(monkeypatch):
    from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput

    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))
    gen = GenerateReqInput(text="x")
    _select(monkeypatch, None)
    assert validate_prompt_ids_hook(manager, gen, []) is None  # not selected: SGLang's own behaviour
    _select(monkeypatch, MinimaConfig())
    with pytest.raises(ValueError, match="no tokens"):
        validate_prompt_ids_hook(manager, gen, [])
    for bad in (-1, 100, 10**12):
        with pytest.raises(ValueError, match=rf"token id {bad} outside the vocabulary \[0, 100\)"):
            validate_prompt_ids_hook(manager, gen, [5, bad, 7])
    assert validate_prompt_ids_hook(manager, gen, [0, 99]) is None
    assert validate_prompt_ids_hook(manager, EmbeddingReqInput(text="x"), []) is None
    assert validate_prompt_ids_hook(manager, GenerateReqInput(text="x", image_data=["img"]), [10**9]) is None


def test_fused_rope_kv_write_is_off_only_when_selected(monkeypatch):
    import sglang.srt.models.utils as model_utils

    install_memory_hooks()
    assert "sglang.srt.models.utils.enable_fused_set_kv_buffer" in HookRegistry._hooks
    fused = lambda forward_batch: True  # noqa: E731  (CUDA with a bf16 pool)
    _select(monkeypatch, None)
    assert fused_kv_write_hook(fused, object()) is True
    _select(monkeypatch, MinimaConfig(hot_dtype="auto"))
    assert fused_kv_write_hook(fused, object()) is False
    assert callable(model_utils.enable_fused_set_kv_buffer)  # the hooked target exists in SGLang 0.5.23


@pytest.mark.parametrize("key_bits", [3, 4])
def test_cell_size_is_the_blended_bytes_per_token(monkeypatch, key_bits):
    config = MinimaConfig(fp8_page_fraction=0.25, key_bits=key_bits)
    tq3_page = TQ3PageLayout(3, 64, 64, key_bits).page_bytes
    expected = 30 * (0.25 * 2 * 3 * 64 + 0.75 * tq3_page / 64)
    cell = minima_cell_size(config, num_kv_heads=3, head_dim=64, num_layers=30, page_size=64, model_dtype_bytes=2)
    assert cell == int(expected) + (expected % 1 > 0)
    # TQ3 bytes per token of the 3 heads: 3 * 54 (3-bit keys), 3 * 62 (4-bit keys)
    assert cell == {3: 30 * (96 + 0.75 * 162), 4: 30 * (96 + 0.75 * 186)}[key_bits]
    assert minima_cell_size(
        MinimaConfig(hot_dtype="auto", disable_stale=True),
        num_kv_heads=3, head_dim=64, num_layers=30, page_size=64, model_dtype_bytes=2,
    ) == 2 * 3 * 64 * 30 * 2  # SGLang's own bf16 cell size

    kvc = SimpleNamespace(
        use_mla_backend=False, page_size=64, kv_cache_dtype=torch.bfloat16,
        model_config=SimpleNamespace(head_dim=64, get_num_kv_heads=lambda tp, dcp: 3),
    )
    sglang_cell = lambda configurator, kvc, num_layers: 2 * 3 * 64 * num_layers * 2  # noqa: E731
    _select(monkeypatch, None)
    assert cell_size_hook(sglang_cell, None, kvc, 30) == 2 * 3 * 64 * 30 * 2
    _select(monkeypatch, config)
    assert cell_size_hook(sglang_cell, None, kvc, 30) == cell


@pytest.mark.parametrize("key_bits,key_center,value_code,value_bits", [
    (3, False, "uniform", 3), (4, False, "uniform", 3), (4, True, "uniform", 3), (4, False, "lloyd-max", 3),
    (4, False, "uniform", 4),
])
def test_pool_allocates_the_bytes_the_cell_size_promised(monkeypatch, key_bits, key_center, value_code, value_bits):
    config = MinimaConfig(fp8_page_fraction=0.25, key_bits=key_bits, key_center=key_center, value_code=value_code,
                          value_bits=value_bits)
    _select(monkeypatch, config)
    pages, layers = 64, 3
    pool = MinimaKVPool(pages * 64, page_size=64, dtype=torch.bfloat16, head_num=3, head_dim=64, layer_num=layers,
                        device="cpu", enable_memory_saver=False)
    assert pool.layout.key_bits == key_bits and pool.codebook.levels == 1 << key_bits
    tq3_page = TQ3PageLayout(3, 64, 64, key_bits, key_center, value_code, value_bits).page_bytes
    assert pool.tq3_buffer(0).shape[1] == tq3_page and pool.layout.key_center == key_center
    assert (pool.layout.value_code, pool.layout.value_bits) == (value_code, value_bits)
    # page-centered keys: 3 heads x 64 dims of fp16 more per page, on the K side; lloyd-max values: 3
    # heads x 64 tokens of fp16 fewer (no zero point); 4-bit values: 3 heads x 64 tokens x 64 dims / 8
    assert tq3_page - TQ3PageLayout(3, 64, 64, key_bits).page_bytes == (
        (3 * 64 * 2 if key_center else 0) - (3 * 64 * 2 if value_code == "lloyd-max" else 0)
        + (3 * 64 * 64 // 8 if value_bits == 4 else 0))
    cell = minima_cell_size(config, num_kv_heads=3, head_dim=64, num_layers=layers, page_size=64, model_dtype_bytes=2)
    padding = 64 * (2 * 3 * 64 + tq3_page / 64) * layers  # one padding page each
    shortfall = cell * pages * 64 - (sum(pool.get_kv_size_bytes()) - padding)
    # ceil() gives under a byte per token; round() of the FP8 page count under half a page.
    assert 0 <= shortfall <= pages * 64 + layers * 64 * 2 * 3 * 64 / 2


@pytest.mark.parametrize("page_size", [1, 8, 24])
def test_pool_refuses_a_page_size_tq3_cannot_hold(monkeypatch, page_size):
    _select(monkeypatch, MinimaConfig())
    with pytest.raises(ValueError, match=f"--page-size to be a multiple of 16.*got --page-size {page_size}$"):
        MinimaKVPool(16 * page_size, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=64,
                     layer_num=1, device="cpu", enable_memory_saver=False)
    with pytest.raises(ValueError, match=f"got --page-size {page_size}$"):
        minima_cell_size(MinimaConfig(), num_kv_heads=2, head_dim=64, num_layers=1, page_size=page_size,
                         model_dtype_bytes=2)


@pytest.mark.parametrize("head_dim", [32, 80, 96])
def test_pool_refuses_a_head_dim_tq3_cannot_hold(monkeypatch, head_dim):
    _select(monkeypatch, MinimaConfig())
    match = f"model's head_dim to be a multiple of 64.*this model has head_dim={head_dim}$"
    with pytest.raises(ValueError, match=match):
        MinimaKVPool(16 * 64, page_size=64, dtype=torch.bfloat16, head_num=2, head_dim=head_dim,
                     layer_num=1, device="cpu", enable_memory_saver=False)
    # The cell-size hook runs first in SGLang (it sizes the pool): the same message, before any allocation.
    kvc = SimpleNamespace(
        use_mla_backend=False, page_size=64, kv_cache_dtype=torch.bfloat16,
        model_config=SimpleNamespace(head_dim=head_dim, get_num_kv_heads=lambda tp, dcp: 2),
    )
    with pytest.raises(ValueError, match=match):
        cell_size_hook(lambda configurator, kvc, num_layers: 0, None, kvc, 4)


def test_prefill_scratch_is_charged_before_sglang_sizes_the_pool(monkeypatch):
    """On CUDA with ``minima`` the prefill's TQ3 tile comes out of the KV budget, as SGLang's own
    KV-shard scratch does (``_fixed_overhead_bytes``), so fewer tokens; nothing elsewhere."""
    import sglang_minima.hooks as hooks
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    install_memory_hooks()
    assert hooks._POOL_SIZING in HookRegistry._hooks
    # the target the AFTER hook wraps takes the configurator and SGLang's KV cache configurator
    assert list(inspect.signature(DefaultPoolConfigurator.__init__).parameters) == ["self", "kvc"]
    kvc = SimpleNamespace(use_mla_backend=False, page_size=64,  # the canary's Qwen3.6 full-attention geometry
                          model_config=SimpleNamespace(head_dim=256, get_num_kv_heads=lambda tp, dcp: 4))
    args = SimpleNamespace(attention_backend="minima", prefill_attention_backend=None, device="cuda")
    monkeypatch.setattr(hooks, "get_server_args", lambda: args)

    def sized_pool(cell: int = 19232, available: int = 4 << 30):
        configurator = SimpleNamespace(_fixed_overhead_bytes=1000, _cell_size=cell, _zero_kv_max_tokens=0)
        hooks.prefill_scratch_hook(None, configurator, kvc)
        tokens = DefaultPoolConfigurator.calculate_pool_sizes(configurator, available, 64).max_total_num_tokens
        return configurator._fixed_overhead_bytes - 1000, tokens

    _select(monkeypatch, MinimaConfig())
    reserve, tokens = sized_pool()
    assert reserve == 64 << 20  # 16,384 tokens x 4 heads x 256 dims, K and V in bf16: the 64.0 MiB the H200 metered
    assert tokens == ((4 << 30) - 1000 - reserve) // 19232 // 64 * 64 < ((4 << 30) - 1000) // 19232 // 64 * 64
    args.prefill_attention_backend = "minima_native"  # the extend path SGLang runs is the prefill backend's
    assert sized_pool()[0] == 0
    args.prefill_attention_backend = None
    for backend, device in [("minima_native", "cuda"), ("minima", "cpu")]:
        args.attention_backend, args.device = backend, device
        assert sized_pool()[0] == 0
    args.attention_backend, args.device = "minima", "cuda"
    kvc.model_config.head_dim = 96  # no Hadamard rotation in the kernels: the torch codec's tile, 12 bytes an element
    assert sized_pool()[0] == 4 * 4096 * 96 * 12
    _select(monkeypatch, None)  # SGLang's own pool: untouched
    assert sized_pool()[0] == 0
