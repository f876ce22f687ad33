"""Every ``--minima-*`` flag over values of every type: either a config the lifecycle runs with, or
exit status 2 with a message naming the flag. Nothing in between (a value that parses but breaks
the scheduler later is the bug this looks for)."""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import fields
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_minima.config import MinimaConfig, flag_name, parse_minima_argv
from sglang_minima.mem_cache.controller import LifecycleController

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mem_cache"))
from store_helpers import PS, make_store, random_kv, write_tokens  # noqa: E402

FIELDS = {f.name: f for f in fields(MinimaConfig)}
VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " ", "nan", "-inf", "1e400", "0x10", "1_000", "true", "fp8_e4m3", "auto", "int4", "--x"]),
    st.text(max_size=8),
)


def _argv(name: str, value: str, inline: bool) -> list[str]:
    flag = flag_name(name)
    if FIELDS[name].type in (bool, "bool"):
        return [flag] if value == "" else [f"{flag}={value}"]
    return [f"{flag}={value}"] if inline else [flag, value]


def _run_lifecycle(config: MinimaConfig) -> None:
    """Two requests of four pages, then the between-step work, under this config."""
    store = make_store(num_logical=16, num_hot=6)
    controller = LifecycleController(store, config)
    sequences = []
    for row in range(2):
        if not controller.reserve_hot(4):  # e.g. Stale disabled: 6 hot pages hold one request of 4
            break
        pages = torch.arange(1 + 4 * row, 5 + 4 * row)
        store.map_new(pages)
        slots = (pages.view(-1, 1) * PS + torch.arange(PS)).flatten()
        write_tokens(store, slots, *random_kv(slots.numel()))
        sequences.append(pages)
    controller.tick(sequences)
    controller.tick(sequences[:1])


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(FIELDS)), value=VALUES, inline=st.booleans())
def test_each_flag_value_runs_or_is_refused_naming_the_flag(name, value, inline):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            config = parse_minima_argv(_argv(name, value, inline))
    except SystemExit as e:
        assert e.code == 2
        assert flag_name(name) in err.getvalue().strip().splitlines()[-1], err.getvalue()
        return
    _run_lifecycle(config)
