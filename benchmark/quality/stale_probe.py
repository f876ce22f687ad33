"""Why chunked prefill over Stale pages loses retrieval: an in-process emulation of Minima's KV.

The model runs in Hugging Face transformers (fp32, or the served bf16 with ``--dtype bfloat16``:
attention still scores in fp32 over the cache); every attention call reads its keys and values
the way Minima stores them: FP8 e4m3 for hot pages, and, for the pages Minima's controller would
have converted before that step, the TQ3 round trip of those FP8 bytes (``encode_pages`` /
``decode_pages`` / ``to_original_space``: the project's codec, bit for bit). The page schedule
follows LifecycleController.classify: after each step, with ``n`` tokens allocated, the sealed
pages that are neither among the last ``recent_pages`` nor the first ``sink_pages`` are Stale and
are converted before the next step. Attention is plain dense softmax over the decoded cache, so
this is the reference the serving path must match; it involves no serving code at all.

Modes (``--modes``), each ``<kv>@<chunk>``: kv is ``fp8`` (every page FP8), ``tq3`` (Minima: Stale
pages TQ3, K and V), ``tq3k`` (Stale keys TQ3, values FP8), ``tq3v`` (Stale values TQ3, keys FP8),
``defer`` (Minima, but a request's pages are converted only once its prefill has ended), ``k4``
(Stale keys with 4-bit rotated codes, values TQ3: +1 bit on the keys, the serving default), ``k4k``
(4-bit Stale keys, values FP8: what k4's 3-bit values cost), ``k4v4`` (4-bit Stale keys, values on
TQ3's per-token min/max grid with 16 levels instead of 8: +1 bit on the values; emulated here only),
``k4lmv`` (4-bit Stale keys, values coded
as the codec benchmark's ``tq3-lmv``: rotated, 3-bit Lloyd-Max codes of the normalized vector and one
fp16 least-squares scale per token, 3 + 16/d bits against TQ3's 3 + 32/d; emulated here only);
chunk is the prefill chunk size in tokens, or ``all`` for one chunk. Modifiers after the kv mode, each
``+``-joined: ``+defer`` (k4 and the others: convert nothing until the prefill has ended, as ``defer``
does for tq3), ``+center`` (page-centered keys: each Stale page's mean key per head, in fp16, is
subtracted before the key code and added back after it; 16 bits per key element per page, 0.25 bits
per element at 64-token pages; the codec's ``key_center`` pages, served with ``--minima-key-center``) and ``+snap<A>`` (observation-window Anchors, the SnapKV rule: when the prefill ends, the
attention mass of the prompt's last ``--snap-window`` queries, summed over layers and heads, picks the
``A`` Stale pages that stay FP8 for the rest of the request; pages already converted stay TQ3), e.g.
``k4+defer+snap4@256``.

Outputs per mode: RULER score on the examples and, for the prompts' last token, the relative
hidden-state error against ``fp8`` at the same chunking, layer by layer (``--trace``), next to each
layer's *local* attention error (TQ3 vs FP8 attention output on identical inputs): error that
grows through the layers well past the local error is compounding, not a kernel bug.

Usage: python benchmark/quality/stale_probe.py --tasks niah_single_2,niah_multikey_1 --n 8 --out run.json
       python benchmark/quality/stale_probe.py --report run.json more.json --reference fp8@256,k4@256
(``--out`` is rewritten after every example; ``--report`` pools runs, complete or cut, and pairs modes.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from needle_tiers import needle_pages  # noqa: E402
from ruler_data import TASKS, Example, generate, string_match_all  # noqa: E402

from sglang_minima.codec.codebook import key_codebook, tq3_codebook  # noqa: E402
from sglang_minima.codec.fp8 import fp8_dequantize, fp8_quantize  # noqa: E402
from sglang_minima.codec.layout import TQ3PageLayout  # noqa: E402
from sglang_minima.codec.rotation import LayerRotation  # noqa: E402
from sglang_minima.codec.tq3 import (  # noqa: E402
    decode_pages, dequantize_values, encode_pages, page_mean_keys, quantize_keys, quantize_values, to_original_space,
)
from sglang_minima.models import default_model_dir  # noqa: E402
from sglang_minima.layers.attention.page_mass import key_mass  # noqa: E402
from sglang_minima.ops.dense import attend, causal_mask  # noqa: E402
from sglang_minima.ops.paged import HotPagedKV, Tq3PagedKV, mixed_paged_attention  # noqa: E402

KV_MODES = ("fp8", "tq3", "tq3k", "tq3v", "defer", "k4", "k4k", "k4v4", "k4lmv")
KEY_BITS = {"k4": 4, "k4k": 4, "k4v4": 4, "k4lmv": 4}
"""Modes whose Stale keys take more bits than TQ3's 3: the same rotation, per-token norm correction
and Lloyd-Max codebook for the sphere, with 2**bits levels."""
STALE_KEYS = ("tq3", "tq3k", "defer", *KEY_BITS)
"""Modes that read a Stale page's keys through a compressed code (the rest read its FP8 keys)."""
STALE_VALUES = ("tq3", "tq3v", "defer", "k4", "k4v4", "k4lmv")
"""Modes that read a Stale page's values through a compressed code: TQ3's, ``k4v4``'s or ``k4lmv``'s."""
VALUE_BITS = {"k4v4": 4}
"""Modes whose Stale values take more bits than TQ3's 3: the same per-token min/max grid, 2**bits levels."""


@dataclass(frozen=True)
class Tiers:
    """The controller's tier parameters (MinimaConfig's recent_pages / sink_pages; one sink page, the
    default until 2026-12-05, as every committed probe ran: ``--sink-pages`` moves it)."""

    page_size: int = 64
    recent_pages: int = 4
    sink_pages: int = 1

    def stale_pages(self, allocated: int) -> set[int]:
        """Sealed pages outside the Recent window and the sinks, with ``allocated`` tokens."""
        num_pages = -(-allocated // self.page_size)
        sealed = allocated // self.page_size
        return {p for p in range(self.sink_pages, min(sealed, num_pages - self.recent_pages))}


@dataclass(frozen=True)
class Mode:
    """One ``--modes`` entry: kv mode, modifiers, prefill chunk (None: one chunk)."""

    kv: str
    chunk: int | None = None
    defer: bool = False
    snap_pages: int = 0
    center: bool = False

    @classmethod
    def parse(cls, mode: str) -> "Mode":
        spec, _, chunk = mode.partition("@")
        kv, *mods = spec.split("+")
        if kv not in KV_MODES:
            raise SystemExit(f"--modes: unknown kv mode {kv!r} in {mode!r} (one of {KV_MODES})")
        defer, snap, center = kv == "defer", 0, False
        for m in mods:
            if m == "defer":
                defer = True
            elif m == "center":
                center = True
            elif m.startswith("snap") and m[4:].isdigit() and int(m[4:]) > 0:
                snap = int(m[4:])
            else:
                raise SystemExit(f"--modes: unknown modifier {m!r} in {mode!r} (+defer, +center, +snap<pages>)")
        if kv == "fp8" and (defer or snap or center):
            raise SystemExit(f"--modes: {mode!r}: fp8 converts nothing, modifiers have no effect")
        if center and kv not in STALE_KEYS:
            raise SystemExit(f"--modes: {mode!r}: +center codes Stale keys, and {kv} keeps them FP8")
        return cls(kv, None if chunk in ("", "all") else int(chunk), defer, snap, center)


@dataclass
class KVState:
    """What the emulated pool holds for the request being run."""

    kv_mode: str = "fp8"
    defer: bool = False
    snap_pages: int = 0
    center: bool = False
    observe: bool = False
    """The last prefill chunk is running: its last ``snap_window`` queries score the keys."""
    key_mass: torch.Tensor | None = None
    """fp32 [tokens]: attention mass of the observation window, summed over layers and heads."""
    anchors: set[int] | None = None
    """Pages the observation window kept FP8 (picked once, when the prefill ends)."""
    converted: set[int] = field(default_factory=set)
    tq3_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    trace_local: bool = False
    local_err: dict[int, float] = field(default_factory=dict)
    check_ops: bool = False
    ops_max_abs: float = 0.0
    ops_max_rel: float = 0.0
    ops_calls: int = 0


class MinimaEmulation:
    def __init__(self, model_dir: Path, tiers: Tiers, rotation_seed: int = 0, device: str = "cpu",
                 snap_window: int = 64, dtype: torch.dtype = torch.float32):
        from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        AttentionInterface.register("minima_emulation", self._attention)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="minima_emulation"
        ).eval().to(device)
        self.device = torch.device(device)
        cfg = self.model.config
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.tiers = tiers
        self.snap_window = snap_window
        self.layout = TQ3PageLayout(self.num_kv_heads, tiers.page_size, self.head_dim)
        self.codebook = tq3_codebook(self.head_dim).to(self.device)
        self.rotations = [
            LayerRotation(self.num_kv_heads, self.head_dim, i, rotation_seed, self.device)
            for i in range(cfg.num_hidden_layers)
        ]
        self.state = KVState()

    # ------------------------------------------------------------------ attention

    def _tq3_page(self, layer: int, page: int, k8: torch.Tensor, v8: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K, V) of one page after the TQ3 round trip, original space [P, H, D], and its TQ3P bytes."""
        key = (layer, page)
        hit = self.state.tq3_cache.get(key)
        if hit is None:
            ps = self.tiers.page_size
            rows = slice(page * ps, (page + 1) * ps)
            # [P, H, D] FP8 bytes -> one TQ3 page [1, H, P, D], as TieredPageStore._encode_layer does.
            kp, vp = k8[rows].permute(1, 0, 2).unsqueeze(0), v8[rows].permute(1, 0, 2).unsqueeze(0)
            enc = encode_pages(kp, vp, self.layout, self.rotations[layer], self.codebook, k_scale=1.0, v_scale=1.0)
            k_rot, v_rot = decode_pages(enc, self.layout, self.codebook)
            rot = self.rotations[layer]
            if self.state.center:
                k_rot = self._centered_keys(rot.rotate(fp8_dequantize(kp), head_axis=-3),
                                            KEY_BITS.get(self.state.kv_mode, 3))
            elif self.state.kv_mode in KEY_BITS:
                k_rot = self._finer_keys(rot.rotate(fp8_dequantize(kp), head_axis=-3), KEY_BITS[self.state.kv_mode])
            if self.state.kv_mode == "k4lmv":
                v_rot = self._lloyd_max_values(rot.rotate(fp8_dequantize(vp), head_axis=-3))
            elif self.state.kv_mode in VALUE_BITS:
                v_rot = self._wider_values(rot.rotate(fp8_dequantize(vp), head_axis=-3), VALUE_BITS[self.state.kv_mode])
            hit = (to_original_space(k_rot, rot)[0].permute(1, 0, 2), to_original_space(v_rot, rot)[0].permute(1, 0, 2),
                   enc[0])
            self.state.tq3_cache[key] = hit
        return hit

    def _finer_keys(self, k_rot: torch.Tensor, bits: int) -> torch.Tensor:
        """Rotated keys through a ``bits``-bit version of TQ3's key code (``quantize_keys``'s steps)."""
        book = key_codebook(self.head_dim, bits).to(k_rot.device)
        centroids, thresholds = book.centroids, book.thresholds
        norm = k_rot.norm(dim=-1, keepdim=True)
        u = k_rot * (self.head_dim**0.5 / norm.clamp_min(1e-30))
        q = centroids[torch.bucketize(u, thresholds)]
        correction = (norm / q.norm(dim=-1, keepdim=True)).to(torch.float16).to(torch.float32)
        return torch.where(norm > 0, correction * q, torch.zeros_like(q))

    def _centered_keys(self, k_rot: torch.Tensor, bits: int) -> torch.Tensor:
        """Rotated keys [1, H, P, D] of one page through the ``bits``-bit key code of their residual
        from the page's mean key per head (fp16), the mean added back: what ``+center`` stores."""
        mean = page_mean_keys(k_rot).to(torch.float32).unsqueeze(-2)  # the codec's (key_center layouts)
        return self._finer_keys(k_rot - mean, bits) + mean

    @staticmethod
    def _wider_values(v_rot: torch.Tensor, bits: int) -> torch.Tensor:
        """Rotated values through the codec's value recipe (per-token min/max grid, fp16 scale and
        zero) with ``bits``-bit codes instead of 3."""
        return dequantize_values(*quantize_values(v_rot, bits), bits)

    def _lloyd_max_values(self, v_rot: torch.Tensor) -> torch.Tensor:
        """Rotated values through the codec benchmark's ``tq3-lmv`` code: 3-bit Lloyd-Max codes of the
        vector scaled to norm sqrt(d) (as keys), and one fp16 scale per token, the least-squares
        ``<v, c> / |c|^2`` for those codes (benchmark/codec/methods.py ``_tq3_lloyd_values``)."""
        book = key_codebook(self.head_dim, 3)
        c = book.centroids.to(v_rot.device)[quantize_keys(v_rot, book)[0].long()]  # the codec's key codes
        scale = ((v_rot * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True).clamp_min(1e-30))
        return scale.to(torch.float16).to(torch.float32) * c

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        st = self.state
        layer = module.layer_idx
        k8 = fp8_quantize(key[0].transpose(0, 1).contiguous())  # [N, H, D] bytes, as set_kv_buffer stores
        v8 = fp8_quantize(value[0].transpose(0, 1).contiguous())
        k, v = fp8_dequantize(k8), fp8_dequantize(v8)
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        n, t = k.shape[0], q.shape[0]
        mask = causal_mask(torch.arange(n - t, n, device=q.device), torch.arange(n, device=q.device))
        k_t, v_t = k.clone(), v.clone()
        ps = self.tiers.page_size
        for page in sorted(st.converted):
            kq, vq, _ = self._tq3_page(layer, page, k8, v8)
            rows = slice(page * ps, (page + 1) * ps)
            if st.kv_mode in STALE_KEYS:
                k_t[rows] = kq
            if st.kv_mode in STALE_VALUES:
                v_t[rows] = vq
        out, lse = attend(q, k_t, v_t, scaling, mask)
        if st.observe:
            self._observe(q, k_t, scaling, lse, mask)
        # (the serving op reads the plain pages in enc: a +center mode's keys are not theirs)
        if st.check_ops and st.converted and st.kv_mode in ("tq3", "defer") and not st.center:
            self._check_ops(layer, q, k8, v8, scaling, out)
        if st.trace_local and st.converted:
            ref, _ = attend(q, k, v, scaling, mask)
            err = float((out[-1] - ref[-1]).norm() / ref[-1].norm())
            st.local_err[layer] = err
        return out.unsqueeze(0).to(query.dtype), None

    def _observe(self, q: torch.Tensor, k: torch.Tensor, scaling: float, lse: torch.Tensor,
                 mask: torch.Tensor) -> None:
        """Add the softmax weights of the chunk's last ``snap_window`` queries to ``key_mass`` (the keys
        as this call read them; ``lse`` is ``attend``'s base-2 log-sum-exp): the serving path's
        per-key mass (page_mass.py), on the emulation's dense keys."""
        w = min(self.snap_window, q.shape[0])
        mass = key_mass(q[-w:], k, scaling, lse[-w:], mask[-w:])
        st = self.state
        st.key_mass = mass if st.key_mass is None else st.key_mass + mass

    def _check_ops(self, layer: int, q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scaling: float,
                   want: torch.Tensor) -> None:
        """The serving op (sglang_minima.ops.paged, as minima_native calls it in extend and decode)
        over FP8 slots and TQ3P pages vs the dense reference ``want`` over the decoded cache."""
        st, ps = self.state, self.tiers.page_size
        n, t = k8.shape[0], q.shape[0]
        pages = sorted(st.converted)
        positions = torch.arange(n)
        on_tq3 = torch.zeros(n, dtype=torch.bool)
        for page in pages:
            on_tq3[page * ps : (page + 1) * ps] = True
        hot = HotPagedKV(k8, v8, positions[~on_tq3], positions[~on_tq3], k_scale=1.0, v_scale=1.0)
        buf = torch.stack([self._tq3_page(layer, p, k8, v8)[2] for p in pages])
        tq3 = Tq3PagedKV(buf, torch.arange(len(pages)), self.layout, self.codebook,
                         torch.tensor(pages, dtype=torch.int64) * ps)
        got, _ = mixed_paged_attention(q, hot, tq3, self.rotations[layer], scaling, torch.arange(n - t, n))
        err = (got - want).abs().max()
        st.ops_max_abs = max(st.ops_max_abs, float(err))
        st.ops_max_rel = max(st.ops_max_rel, float(err / want.abs().max()))
        st.ops_calls += 1

    # ------------------------------------------------------------------ requests

    def answer_pages(self, prompt: str, outputs: list[str]) -> set[int]:
        """Pages holding the expected answers' first tokens (where each occurs in the prompt)."""
        offsets = self.tok(prompt, return_offsets_mapping=True)["offset_mapping"]
        return set(needle_pages(offsets, prompt, outputs, self.tiers.page_size))

    def _tick(self, allocated: int, prefilling: bool) -> None:
        st = self.state
        if st.kv_mode == "fp8" or (st.defer and prefilling):
            return
        stale = self.tiers.stale_pages(allocated)
        if st.snap_pages and st.anchors is None and not prefilling:
            # the prefill has just ended: the window's heaviest pages among those not yet converted
            ps = self.tiers.page_size
            mass = st.key_mass.to("cpu")
            candidates = sorted(stale - st.converted,
                                key=lambda pg: -float(mass[pg * ps : (pg + 1) * ps].sum()))
            st.anchors = set(candidates[: st.snap_pages])
            st.key_mass = None
        st.converted |= stale - (st.anchors or set())

    @torch.no_grad()
    def run(self, prompt: str, mode: Mode | str, max_new_tokens: int, trace: bool = False,
            check_ops: bool = False) -> tuple[str, list[torch.Tensor], dict[int, float]]:
        """Greedy answer; with ``trace`` also the last prompt token's hidden state per layer and the
        local attention error per layer in the last prefill chunk."""
        from transformers import DynamicCache

        mode = Mode.parse(mode) if isinstance(mode, str) else mode
        self.state = KVState(kv_mode=mode.kv, defer=mode.defer, snap_pages=mode.snap_pages, center=mode.center,
                             check_ops=check_ops)
        ids = self.tok(prompt, return_tensors="pt").input_ids.to(self.device)
        n = ids.shape[1]
        chunk = mode.chunk or n
        cache = DynamicCache(config=self.model.config)
        hidden: list[torch.Tensor] = []
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            last = end == n
            self.state.trace_local = trace and last
            self.state.observe = last and self.state.snap_pages > 0
            out = self.model(ids[:, start:end], past_key_values=cache, use_cache=True,
                             output_hidden_states=trace and last)
            if trace and last:
                hidden = [h[0, -1].clone() for h in out.hidden_states]
            self._tick(end, prefilling=not last)
        local = dict(self.state.local_err)
        self.state.trace_local = self.state.observe = False
        tokens = []
        nxt = out.logits[0, -1].argmax()
        for step in range(max_new_tokens):
            tokens.append(int(nxt))
            if int(nxt) == self.tok.eos_token_id:
                break
            out = self.model(nxt.view(1, 1), past_key_values=cache, use_cache=True)
            self._tick(n + step + 1, prefilling=False)
            nxt = out.logits[0, -1].argmax()
        return self.tok.decode(tokens, skip_special_tokens=True), hidden, local


def example_keys(spec: str) -> tuple[str, ...]:
    """``--keys``: example keys (``task/length/index``) comma-separated, or ``@FILE``, one a line (sorted:
    the run's JSON records them)."""
    text = Path(spec[1:]).read_text() if spec.startswith("@") else spec.replace(",", "\n")
    keys = {k.strip() for k in text.splitlines() if k.strip()}
    if not keys:
        raise argparse.ArgumentTypeError(f"--keys {spec!r}: no example key")
    return tuple(sorted(keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--n", type=int, default=8, help="examples per task")
    ap.add_argument("--modes", default="fp8@all,tq3@all,fp8@128,tq3@128,tq3k@128,tq3v@128,defer@128")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--start", type=int, default=0,
                    help="skip the first examples of the round robin (those an earlier run answered)")
    ap.add_argument("--keys", type=example_keys, default=None, metavar="KEYS|@FILE",
                    help="only these examples (task/length/index, comma-separated, or a file of one a line): "
                         "the ones a served run lost, say, out of --tasks' first --n")
    ap.add_argument("--recent-pages", type=int, default=4)
    ap.add_argument("--sink-pages", type=int, default=1)
    ap.add_argument("--snap-window", type=int, default=64,
                    help="+snap modes: the prompt's last queries whose attention picks the Anchors")
    ap.add_argument("--check-ops", action="store_true",
                    help="also run the serving op (ops.paged.mixed_paged_attention) on every call that "
                         "reads TQ3 pages and report its largest deviation from the dense reference")
    ap.add_argument("--out", type=Path, default=None, help="JSON with every answer and trace")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the device harness: seconds, not hours)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's weights and activations (bfloat16: the served model's; attention still "
                         "scores in fp32 over the cache, as the kernels do, and returns the model's dtype)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no example after this many seconds from launch (a device call's limit; one example "
                         "takes ~11 s of the H200 for four modes); the report covers the examples done")
    ap.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                    help="no run: pool these runs' records (--out files, complete or cut) and print each mode's "
                         "score, paired differences against --reference and the hidden-state error")
    ap.add_argument("--reference", default="fp8@all",
                    help="--report: the modes each mode is paired against, comma-separated")
    args = ap.parse_args()
    if args.report:
        print(report(args.report, args.reference.split(",")))
        return
    started = time.time()  # the budget counts the model's load and RULER's generation too
    if args.check_ops and args.device != "cpu":
        raise SystemExit("--check-ops: the torch serving op runs on --device cpu only")
    torch.set_num_threads(1)
    tiers = Tiers(recent_pages=args.recent_pages, sink_pages=args.sink_pages)
    modes = args.modes.split(",")
    parsed = {m: Mode.parse(m) for m in modes}  # a bad mode fails before the model loads
    emu = MinimaEmulation(default_model_dir(), tiers, device=args.device, snap_window=args.snap_window,
                          dtype=getattr(torch, args.dtype))
    per_task: list[list[Example]] = []
    for task in args.tasks.split(","):
        if task not in TASKS:
            raise SystemExit(f"--tasks: unknown task {task!r}")
        per_task.append(generate(task, args.length, args.n, default_model_dir()))
    # round robin over the tasks: a run cut by --time-budget-s covers every task alike
    examples: list[Example] = [ex for group in zip(*per_task) for ex in group][args.start:]
    if args.keys is not None:
        wanted = set(args.keys)
        if missing := sorted(wanted - {ex.key for ex in examples}):
            raise SystemExit(f"--keys: not among --tasks' first --n examples at --length: {missing[:5]}")
        examples = [ex for ex in examples if ex.key in wanted]
    results: dict[str, dict] = {m: {"scores": [], "answers": [], "hidden_err": [], "local_err": [], "ops": [],
                                    "anchors": [], "answer_pages": []} for m in modes}
    t0 = time.time()
    done = []
    for ex in tqdm(examples, desc="examples"):
        if args.time_budget_s is not None and time.time() - started > args.time_budget_s:
            break
        done.append(ex)
        hidden_ref: dict[int | None, list[torch.Tensor]] = {}
        for mode in modes:
            m = parsed[mode]
            answer, hidden, local = emu.run(ex.prompt, m, args.max_new_tokens, trace=True,
                                            check_ops=args.check_ops)
            r = results[mode]
            st = emu.state
            r["ops"].append({"calls": st.ops_calls, "max_abs": st.ops_max_abs, "max_rel": st.ops_max_rel})
            r["scores"].append(string_match_all(answer, ex.outputs))
            if m.snap_pages:  # did the window keep the answers' pages FP8?
                r["anchors"].append(sorted(st.anchors or ()))
                r["answer_pages"].append(sorted(emu.answer_pages(ex.prompt, ex.outputs)))
            r["answers"].append(answer)
            r["local_err"].append([local.get(i, 0.0) for i in range(len(hidden) - 1)])
            if m.kv == "fp8":
                hidden_ref[m.chunk] = hidden
            ref = hidden_ref.get(m.chunk)
            r["hidden_err"].append(
                [float((h.float() - g.float()).norm() / g.float().norm()) for h, g in zip(hidden, ref)] if ref else []
            )
        if args.out:  # every example's records as it ends: a run cut short keeps what it answered
            _write(args, {"results": results, "examples": [e.key for e in done]})
    summary = {}
    for mode, r in results.items():
        errs = [e for e in r["hidden_err"] if e]
        mean_err = [sum(col) / len(col) for col in zip(*errs)] if errs else []
        local = [sum(col) / len(col) for col in zip(*r["local_err"])]
        summary[mode] = {
            "score": sum(r["scores"]) / len(r["scores"]),
            "hidden_err_by_layer": mean_err,
            "local_attn_err_by_layer": local,
        }
        if r["anchors"]:
            kept = [len(set(a) & set(p)) / len(p) for a, p in zip(r["anchors"], r["answer_pages"]) if p]
            summary[mode]["answer_pages_kept"] = sum(kept) / len(kept) if kept else math.nan
        ops = [o for o in r["ops"] if o["calls"]]
        summary[mode]["ops_check"] = {
            "calls": sum(o["calls"] for o in ops),
            "max_abs": max((o["max_abs"] for o in ops), default=0.0),
            "max_rel": max((o["max_rel"] for o in ops), default=0.0),
        }
        print(f"{mode:>10}: RULER {summary[mode]['score']:6.2f} over {len(r['scores'])} examples"
              + (f"; serving op vs dense reference over {summary[mode]['ops_check']['calls']} attention calls: "
                 f"max |diff| {summary[mode]['ops_check']['max_abs']:.2e} "
                 f"(rel. {summary[mode]['ops_check']['max_rel']:.2e})" if ops else "")
              + (f"; answer pages kept FP8 by the window: {summary[mode]['answer_pages_kept']:.0%}"
                 if "answer_pages_kept" in summary[mode] else ""))
    print("\nlayer  " + "  ".join(f"{m:>16}" for m in modes))
    nl = len(next(iter(summary.values()))["local_attn_err_by_layer"])
    for layer in range(nl):
        cells = []
        for m in modes:
            s = summary[m]
            h = s["hidden_err_by_layer"][layer + 1] if s["hidden_err_by_layer"] else math.nan
            cells.append(f"{h:7.4f}/{s['local_attn_err_by_layer'][layer]:7.4f}")
        print(f"{layer:5d}  " + "  ".join(f"{c:>16}" for c in cells))
    print(f"(hidden-state rel. error after the layer vs fp8 at the same chunking / local attention rel. error; "
          f"{time.time() - t0:.0f}s)")
    if args.out:
        _write(args, {"summary": summary, "results": results, "examples": [ex.key for ex in done]})


def pooled(paths: Sequence[Path]) -> dict[str, dict[str, dict]]:
    """mode -> example key -> {task, score, hidden error after the last layer}, over several runs'
    records; an example answered by two runs counts once (the first)."""
    out: dict[str, dict[str, dict]] = {}
    for path in paths:
        rec = json.loads(Path(path).read_text())
        keys = rec["examples"]
        for mode, r in rec["results"].items():
            mine = out.setdefault(mode, {})
            for i, key in enumerate(keys[: len(r["scores"])]):  # a cut run: its last example may lack modes
                err = r["hidden_err"][i] if i < len(r["hidden_err"]) else []
                mine.setdefault(key, {"task": key.split("/")[0], "score": r["scores"][i],
                                      "hidden": err[-1] if err else math.nan})
    return out


def report(paths: Sequence[Path], references: Sequence[str]) -> str:
    """Markdown: per mode, examples, RULER score, the paired difference against each reference (the
    macro over tasks of per-task mean differences, bootstrap 95% interval resampling examples within
    each task), the worst task's difference, and the mean hidden-state error after the last layer."""
    from niah import fmt_diff, macro_ci, macro_diff

    records = pooled(paths)
    missing = [r for r in references if r not in records]
    if missing:
        raise SystemExit(f"--reference: no records of {missing} in these runs (modes: {sorted(records)})")
    head = "| mode | examples | score | " + " | ".join(f"Δ vs {r} [95% CI]" for r in references)
    lines = [head + " | worst task vs " + references[0] + " | hidden err, last layer |",
             "|---" * (5 + len(references)) + "|"]
    for mode, got in records.items():
        cells = []
        worst = ""
        for n, ref in enumerate(references):
            per_task: dict[str, list[float]] = {}
            for key, r in got.items():
                if key in records[ref]:
                    per_task.setdefault(r["task"], []).append(r["score"] - records[ref][key]["score"])
            diffs = [per_task[t] for t in sorted(per_task)]
            cells.append("-" if mode == ref else fmt_diff(macro_diff(diffs), macro_ci(diffs, 2000, 0)))
            if n == 0 and mode != ref and per_task:
                task, d = min(((t, sum(v) / len(v)) for t, v in per_task.items()), key=lambda x: x[1])
                worst = f"{task} {d:+.1f}"
        score = sum(r["score"] for r in got.values()) / len(got)
        hidden = [r["hidden"] for r in got.values() if not math.isnan(r["hidden"])]
        err = f"{sum(hidden) / len(hidden):.4f}" if hidden else "-"
        lines.append(f"| {mode} | {len(got)} | {score:.1f} | " + " | ".join(cells) + f" | {worst or '-'} | {err} |")
    return "\n".join(lines)


def _write(args: argparse.Namespace, record: dict) -> None:
    """The run's JSON (``--out``), replaced whole: a reader never sees half a file."""
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}} | record, indent=1))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
