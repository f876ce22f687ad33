"""MinimaConfig: the one validated object built from ``--minima-*`` flags (or the environment).

The launcher parses the flags, validates them here, and hands the result to every SGLang
subprocess as JSON in ``SGLANG_MINIMA_CONFIG`` (spawned schedulers inherit the environment).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

CONFIG_ENV = "SGLANG_MINIMA_CONFIG"
FLAG_PREFIX = "--minima-"

HOT_DTYPES = ("fp8_e4m3", "auto")
CODE_BITS = (3, 4)
"""Key and value code widths of Stale pages (codec.layout.KEY_BITS_CHOICES / VALUE_BITS_CHOICES; this
module imports no torch)."""
VALUE_CODES = ("uniform", "lloyd-max")
"""What a Stale page's value code means (codec.layout.VALUE_CODES)."""
MAX_PAGES = 2**31 - 1
"""Largest page count a flag may give: page counts are compared with int32 page-table entries."""
MAX_SEED = 2**63 - 1


def _option(default, help: str):
    """A config field and its ``--help`` text."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class MinimaConfig:
    """Minima-KV settings. Each field is the flag ``--minima-<field-with-dashes>``."""

    recent_pages: int = _option(
        4, "Last pages of each request kept hot: FP8, or the model dtype with --minima-hot-dtype auto (Recent tier)."
    )
    sink_pages: int = _option(
        2,
        "First pages of each sequence kept hot (Anchor tier, attention sinks). Two: needles on the page "
        "right after the first lost most under TQ3 (docs/results/quality.md).",
    )
    anchor_pages: int = _option(
        0, "Extra Anchor budget per request, filled by score (age, structure, attention score)."
    )
    fp8_page_fraction: float = _option(
        0.25, "Fraction of the logical pages that can be backed by hot pages (FP8, or the model dtype); the rest are TQ3 pages."
    )
    hot_dtype: str = _option(
        "fp8_e4m3", "Storage of Recent/Anchor pages: fp8_e4m3, or auto (the model dtype: SGLang's own path)."
    )
    disable_stale: bool = _option(
        False, "Never convert pages to TQ3 (every page stays in the hot format)."
    )
    defer_prefill_conversion: bool = _option(
        True,
        "Keep a request's own pages hot until its prefill has ended, so later prefill chunks never read "
        "its prompt's TQ3 pages; they are still converted when an allocation finds no free hot page.",
    )
    strict_hot_admission: bool = _option(
        False,
        "Prefill admission counts only the hot pages it can free without converting a live request's Anchor "
        "or Recent pages: a new prompt waits for hot pages instead of taking a running request's FP8 pages. "
        "A running request's next decode page may still convert them.",
    )
    retier_batch_pages: int = _option(
        64,
        "Pages converted to TQ3 between steps: this many, or as many as were allocated since the last time where "
        "that is more (conversions keep pace with a wave of prompts), launched this many at a time; pages "
        "promoted back: at most this many.",
    )
    pressure_batch_pages: int = _option(
        0,
        "Pages an allocation that finds no free FP8 page converts at its device sync: its shortfall, in the "
        "pressure order, and up to this many in all from Stale pages and cached pages (not a prefix matched "
        "since the last tick), so that the allocations after it find free pages without another sync. "
        "0: the shortfall only.",
    )
    tick_min_new_pages: int = _option(
        1,
        "Pages the live requests must have added since the last lifecycle tick (classification, conversions, "
        "promotions) before the next one runs; 1: at every page boundary. A request that starts or ends, a "
        "prefill that ends, conversions to publish, a conversion batch the last tick filled, or fewer free FP8 "
        "pages than the wait could need run it at once.",
    )
    attention_score_anchors: bool = _option(
        False, "Fill the Anchor budget by the attention score (EWMA of page attention mass)."
    )
    score_ewma: float = _option(
        0.9, "EWMA decay of the per-page attention score."
    )
    anchor_window: int = _option(
        0,
        "Fill the Anchor budget once, when a request's prefill ends, with the pages its last N prompt tokens "
        "attend most (an observation window: a prompt's closing question points at what the answer needs); "
        "they stay hot for the request's life. 0: off.",
    )
    rotation_seed: int = _option(
        0, "Seed of the randomized Hadamard rotations (one per layer and KV head)."
    )
    key_bits: int = _option(
        4,
        "Bits per key code of Stale (TQ3) pages: 4 (a 16-level codebook) or 3 (8 levels: 1 bit less per key "
        "element, more tokens per byte, a larger loss in retrieval).",
    )
    key_center: bool = _option(
        False,
        "Page-centered Stale keys: each TQ3 page keeps its mean rotated key per head (fp16, 16 bits per key "
        "element per page) and codes the keys' residual from it (docs/TQ3P.md). Served by both attention "
        "backends (the kernels add each page's q.mean); off: no gain in served answers (docs/results/quality.md).",
    )
    value_code: str = _option(
        "uniform",
        "What the value codes of Stale (TQ3) pages mean: uniform (a per-token min/max grid, fp16 scale "
        "and zero) or lloyd-max (the rotated value coded as keys are, one fp16 least-squares scale: 16 "
        "bits per value element per token fewer; docs/TQ3P.md). lloyd-max is served by the torch path "
        "(minima_native); the GPU kernels do not read it yet.",
    )
    value_bits: int = _option(
        3,
        "Bits per value code of Stale (TQ3) pages: 3 (8 levels) or 4 (16 levels: 1 bit more per value element, "
        "0.22 of the uniform grid's squared error). 4 is served by the torch path (minima_native); "
        "the GPU kernels do not read it yet.",
    )

    def __post_init__(self) -> None:
        for name in ("recent_pages", "sink_pages", "anchor_pages", "retier_batch_pages", "pressure_batch_pages",
                     "tick_min_new_pages", "rotation_seed", "anchor_window"):
            value, top = getattr(self, name), MAX_SEED if name == "rotation_seed" else MAX_PAGES
            if not 0 <= value <= top:
                raise ValueError(f"{flag_name(name)} must be in [0, {top}], got {value}")
        if self.recent_pages < 1:
            raise ValueError(
                f"{flag_name('recent_pages')} must be >= 1 (the page being written is Recent), "
                f"got {self.recent_pages}"
            )
        for name in ("retier_batch_pages", "tick_min_new_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag_name(name)} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.fp8_page_fraction <= 1.0:
            raise ValueError(
                f"{flag_name('fp8_page_fraction')} must be in (0, 1], got {self.fp8_page_fraction}"
            )
        if self.hot_dtype not in HOT_DTYPES:
            raise ValueError(f"{flag_name('hot_dtype')} must be one of {HOT_DTYPES}, got {self.hot_dtype!r}")
        if not 0.0 <= self.score_ewma < 1.0:
            raise ValueError(f"{flag_name('score_ewma')} must be in [0, 1), got {self.score_ewma}")
        if self.anchor_window > 0 and self.anchor_pages == 0:
            raise ValueError(f"{flag_name('anchor_window')} {self.anchor_window} fills the Anchor budget: give "
                             f"{flag_name('anchor_pages')} > 0")
        if self.anchor_window > 0 and self.attention_score_anchors:
            raise ValueError(f"{flag_name('anchor_window')} and {flag_name('attention_score_anchors')} both fill the "
                             "Anchor budget: give one")
        if self.value_code not in VALUE_CODES:
            raise ValueError(f"{flag_name('value_code')} must be one of {VALUE_CODES}, got {self.value_code!r}")
        for name in ("key_bits", "value_bits"):
            value = getattr(self, name)
            if type(value) is not int or value not in CODE_BITS:
                raise ValueError(f"{flag_name(name)} must be one of {', '.join(map(str, CODE_BITS))}, got {value!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "MinimaConfig":
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{CONFIG_ENV} has unknown keys {unknown}")
        return cls(**data)


def flag_name(field_name: str) -> str:
    return FLAG_PREFIX + field_name.replace("_", "-")


def negated_flag_name(field_name: str) -> str:
    """The flag that turns a boolean setting off: ``--minima-no-<field-with-dashes>``."""
    return flag_name("no_" + field_name)


def _is_bool_flag(name: str) -> bool:
    """Whether ``name`` (a flag without ``--minima-``, dashes as underscores) takes no value."""
    bools = {f.name for f in fields(MinimaConfig) if f.type in (bool, "bool")}
    return name in bools or (name.startswith("no_") and name[3:] in bools)


def add_minima_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--minima-*`` flag per MinimaConfig field (ServerArgs style)."""
    group = parser.add_argument_group("Minima-KV")
    for f in fields(MinimaConfig):
        dest = "minima_" + f.name
        doc = f.metadata["help"]
        if f.type in (bool, "bool"):
            # a pair, so that a default can be turned either way: --minima-x / --minima-no-x
            group.add_argument(flag_name(f.name), dest=dest, action="store_true", default=f.default,
                               help=f"{doc} (default: {'on' if f.default else 'off'}; {negated_flag_name(f.name)} turns it off)")
            group.add_argument(negated_flag_name(f.name), dest=dest, action="store_false", help=argparse.SUPPRESS)
        else:
            py_type = {"int": int, "float": float, "str": str}[str(f.type)]
            choices = {"hot_dtype": HOT_DTYPES, "key_bits": CODE_BITS, "value_bits": CODE_BITS, "value_code": VALUE_CODES}.get(f.name)
            group.add_argument(
                flag_name(f.name), dest=dest, type=py_type, default=f.default, choices=choices,
                help=f"{doc} (default: {f.default})",
            )


def config_from_namespace(ns: argparse.Namespace) -> MinimaConfig:
    return MinimaConfig(**{f.name: getattr(ns, "minima_" + f.name) for f in fields(MinimaConfig)})


def split_minima_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split argv into (minima flags with their values, everything else for SGLang)."""
    minima_args: list[str] = []
    rest: list[str] = []
    take_value = False
    for arg in argv:
        if take_value:
            minima_args.append(arg)
            take_value = False
        elif arg.startswith(FLAG_PREFIX):
            minima_args.append(arg)
            name = arg.split("=", 1)[0][len(FLAG_PREFIX):].replace("-", "_")
            take_value = "=" not in arg and not _is_bool_flag(name)
        else:
            rest.append(arg)
    return minima_args, rest


def parse_minima_argv(minima_args: Sequence[str]) -> MinimaConfig:
    """Parse ``--minima-*`` flags; an unknown or bad flag raises SystemExit with argparse's message."""
    parser = argparse.ArgumentParser(prog="sglang_minima.launch_server", add_help=False, allow_abbrev=False)
    add_minima_cli_args(parser)
    ns = parser.parse_args(list(minima_args))
    try:
        return config_from_namespace(ns)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def set_active_config(config: MinimaConfig) -> None:
    """Select Minima for this process and its children."""
    os.environ[CONFIG_ENV] = config.to_json()


def get_active_config() -> MinimaConfig | None:
    """The config selected for this process, or None when Minima is not selected."""
    text = os.environ.get(CONFIG_ENV)
    return MinimaConfig.from_json(text) if text else None


def config_summary(config: MinimaConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
