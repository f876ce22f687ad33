"""Which kernel of the mixed decode is off, on one test batch: the FP8 part's split partials against
the torch reference of the FP8 pages alone, and the epilogue against a torch combine + un-rotation of
the kernels' own partials. Written for the one run (2026-12-01 09:13 UTC) where every head-dim-256
test with fp8_kernel="tilelang" failed; a fresh machine then passed them all (docs/results/kernels.md).

    PYTHONPATH=kernels:python:test/gpu python3 scripts/device/diag_d256.py [geometry: 24/4/256/64] [repeats: 3]
"""

import sys

import torch
from kv_fixtures import make_batch
from minima_kernels import MinimaDecodeWrapper
from sglang_minima.ops import HotPagedKV, mixed_paged_attention


def torch_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split partials [B, H, S, D], [B, H, S] (base 2) -> (out [B, H, D], lse [B, H]); empty heads NaN / -inf."""
    top = lse_partial.max(-1, keepdim=True).values
    weights = torch.exp2(lse_partial - top).nan_to_num(0.0)
    den = weights.sum(-1)
    return (weights.unsqueeze(-1) * out_partial).sum(2) / den.unsqueeze(-1), torch.log2(den) + top.squeeze(-1)


def fp8_part_errors(batch, out: torch.Tensor, lse: torch.Tensor, h: int, d: int, p: int) -> list[tuple[float, float]]:
    """(relative error of out, max |dLSE|) of the FP8 part per request with FP8 pages."""
    errors = []
    for b in range(batch.batch):
        pages = batch.fp8_page_ids[batch.fp8_indptr[b] : batch.fp8_indptr[b + 1]].long()
        if not pages.numel():
            continue
        slots = (pages.view(-1, 1) * p + torch.arange(p)).reshape(-1)
        slots = slots[: slots.numel() - (p - int(batch.fp8_last_page_len[b]))].cuda()
        hot = HotPagedKV(batch.k_fp8.view(-1, h, d), batch.v_fp8.view(-1, h, d), slots, k_scale=batch.k_scale, v_scale=batch.v_scale)
        ref_out, ref_lse = mixed_paged_attention(batch.q[b : b + 1].float(), hot, None, batch.rotation, d**-0.5)
        errors.append((float((out[b] - ref_out[0]).norm() / ref_out[0].norm()), float((lse[b] - ref_lse[0]).abs().max())))
    return errors


def main() -> None:
    hq, h, d, p = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "24/4/256/64").split("/"))
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for kernel in ("tilelang", "fused"):
        for rep in range(repeats):
            # test_mixed_decode_matches_reference's batch
            batch = make_batch(hq, h, d, p, [1, 3, 2, 1, 2], [9, 0, 5, 13, 1], [1, p - 1, p, 7, 3], seed=hq + p)
            wrapper = MinimaDecodeWrapper(workspace, hq, h, d, p, fp8_kernel=kernel)
            wrapper.overlap_fp8 = False
            wrapper.plan(*batch.plan_args())
            f, t = wrapper.fp8_plan, wrapper.tq3_plan
            for buf in (f.out_partial, f.lse_partial, t.out_partial, t.lse_partial, wrapper._out, wrapper._lse):
                buf.fill_(float("nan"))
            kv = (batch.k_fp8.view(torch.float8_e4m3fn), batch.v_fp8.view(torch.float8_e4m3fn))
            out, _ = wrapper.run(batch.q, kv, batch.tq3_pages, batch.rotation.signs.cuda(), k_scale=batch.k_scale, v_scale=batch.v_scale)
            torch.cuda.synchronize()
            fp8_out, fp8_lse = torch_combine(f.out_partial, f.lse_partial)
            tq3_out, tq3_lse = torch_combine(t.out_partial, t.lse_partial)
            tq3_out = batch.rotation.unrotate(tq3_out.nan_to_num(0.0), head_axis=1)
            top = torch.maximum(tq3_lse, fp8_lse)
            w_tq3, w_fp8 = torch.exp2(tq3_lse - top).nan_to_num(0.0), torch.exp2(fp8_lse - top).nan_to_num(0.0)
            expected = (w_tq3.unsqueeze(-1) * tq3_out + w_fp8.unsqueeze(-1) * fp8_out.nan_to_num(0.0)) / (w_tq3 + w_fp8).unsqueeze(-1)
            epilogue_err = float((out.float() - expected).norm() / expected.norm())
            unwritten = int(torch.isnan(f.out_partial).sum()), int(torch.isnan(f.lse_partial).sum())
            errors = [(f"{a:.1e}", f"{b:.1e}") for a, b in fp8_part_errors(batch, fp8_out, fp8_lse, h, d, p)]
            print(
                f"{kernel} rep {rep}: splits TQ3 {t.num_splits} FP8 {f.num_splits}; NaN left in FP8 out/lse {unwritten}; "
                f"FP8 part vs torch (rel, |dlse|) {errors}; epilogue vs torch on its inputs {epilogue_err:.2e} (bf16 output)",
                flush=True,
            )


if __name__ == "__main__":
    main()
