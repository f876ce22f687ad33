from __future__ import annotations

import dataclasses

import pytest

from sglang_minima.config import (
    CONFIG_ENV,
    MinimaConfig,
    get_active_config,
    parse_minima_argv,
    set_active_config,
    split_minima_argv,
)


def test_split_keeps_sglang_flags_in_order():
    minima, rest = split_minima_argv(
        ["--port", "3000", "--minima-recent-pages", "3", "--minima-disable-stale",
         "--minima-hot-dtype=auto", "--page-size", "16"])
    assert minima == ["--minima-recent-pages", "3", "--minima-disable-stale", "--minima-hot-dtype=auto"]
    assert rest == ["--port", "3000", "--page-size", "16"]


def test_parse_builds_validated_config():
    cfg = parse_minima_argv(["--minima-recent-pages", "3", "--minima-disable-stale",
                             "--minima-fp8-page-fraction", "0.5"])
    assert cfg == dataclasses.replace(MinimaConfig(), recent_pages=3, disable_stale=True, fp8_page_fraction=0.5)


def test_every_boolean_flag_turns_its_setting_either_way(monkeypatch):
    """``--minima-x`` sets, ``--minima-no-x`` clears, the last one given wins: a boolean whose default
    is on can still be turned off (and the split keeps both spellings without a value)."""
    bools = [f for f in dataclasses.fields(MinimaConfig) if f.type in (bool, "bool")]
    assert bools
    for f in bools:
        on, off = "--minima-" + f.name.replace("_", "-"), "--minima-no-" + f.name.replace("_", "-")
        minima, rest = split_minima_argv([off, "--port", "3000", on])
        assert minima == [off, on] and rest == ["--port", "3000"]
        assert getattr(parse_minima_argv([off, on]), f.name) is True
        assert getattr(parse_minima_argv([on, off]), f.name) is False
        assert getattr(parse_minima_argv([]), f.name) is f.default
    # a default that is on (patched, so the check does not hang on which defaults are on today): the negated
    # flag alone turns it off
    monkeypatch.setattr(MinimaConfig.__dataclass_fields__["disable_stale"], "default", True)
    assert parse_minima_argv([]).disable_stale is True
    assert parse_minima_argv(["--minima-no-disable-stale"]).disable_stale is False


@pytest.mark.parametrize("argv, flag", [
    (["--minima-recent-pagez", "1"], "--minima-recent-pagez"),
    (["--minima-recent-pages", "0"], "--minima-recent-pages"),
    (["--minima-sink-pages", "-2"], "--minima-sink-pages"),
    (["--minima-fp8-page-fraction", "0"], "--minima-fp8-page-fraction"),
    (["--minima-hot-dtype", "int8"], "--minima-hot-dtype"),
    (["--minima-score-ewma", "1.0"], "--minima-score-ewma"),
    (["--minima-retier-batch-pages", "x"], "--minima-retier-batch-pages"),
    (["--minima-tick-min-new-pages", "0"], "--minima-tick-min-new-pages"),
    (["--minima-key-bits", "5"], "--minima-key-bits"),
    (["--minima-key-bits", "2"], "--minima-key-bits"),
    (["--minima-key-bits", "four"], "--minima-key-bits"),
    (["--minima-anchor-window", "-1"], "--minima-anchor-window"),
    (["--minima-anchor-window", "64"], "--minima-anchor-pages"),  # a window with no Anchor budget to fill
    (["--minima-anchor-window", "64", "--minima-anchor-pages", "4", "--minima-attention-score-anchors"],
     "--minima-attention-score-anchors"),
])
def test_bad_values_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_minima_argv(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_config_round_trips_through_environment(monkeypatch):
    # set, then deleted: monkeypatch records the variable (a delenv of an absent one records nothing)
    # and removes what set_active_config writes, which servers of later tests would inherit
    monkeypatch.setenv(CONFIG_ENV, "{}")
    monkeypatch.delenv(CONFIG_ENV)
    assert get_active_config() is None
    cfg = MinimaConfig(recent_pages=7, attention_score_anchors=True)
    set_active_config(cfg)
    assert get_active_config() == cfg


def test_unknown_environment_key_is_rejected(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, '{"recent_pages": 2, "bogus": 1}')
    with pytest.raises(ValueError, match="bogus"):
        get_active_config()


def test_key_bits_flag():
    # 4-bit keys by default: RULER NIAH on the H200 (docs/results/quality.md), -1.6 pp against FP8 where
    # 3-bit keys lost 7.8, for 227 KV bytes per attended token against 205
    assert MinimaConfig().key_bits == 4
    assert parse_minima_argv(["--minima-key-bits", "4"]).key_bits == 4
    assert parse_minima_argv(["--minima-key-bits=3"]).key_bits == 3
    assert parse_minima_argv(["--minima-key-center"]).key_center and not parse_minima_argv([]).key_center
    for bad in (5, 0, 3.0, True):  # the environment's JSON path: the same check, naming the flag
        with pytest.raises(ValueError, match=r"--minima-key-bits must be one of 3, 4, got"):
            MinimaConfig(key_bits=bad)


def test_value_bits_flag():
    assert MinimaConfig().value_bits == 3  # 4-bit values stay an option until their measurement says otherwise
    assert parse_minima_argv(["--minima-value-bits", "4"]).value_bits == 4
    with pytest.raises(SystemExit):  # argparse's choices
        parse_minima_argv(["--minima-value-bits", "8"])
    for bad in (2, 4.0, False):  # the environment's JSON path: the same check, naming the flag
        with pytest.raises(ValueError, match=r"--minima-value-bits must be one of 3, 4, got"):
            MinimaConfig(value_bits=bad)


def test_value_code_flag():
    from sglang_minima.codec.layout import KEY_BITS_CHOICES, VALUE_BITS_CHOICES, VALUE_CODES as LAYOUT_VALUE_CODES
    from sglang_minima.config import CODE_BITS, VALUE_CODES

    # the config's copies of the layout's choices (it imports no torch): the same, in the same order
    assert VALUE_CODES == LAYOUT_VALUE_CODES and CODE_BITS == KEY_BITS_CHOICES == VALUE_BITS_CHOICES
    assert MinimaConfig().value_code == "uniform"
    assert parse_minima_argv(["--minima-value-code", "lloyd-max"]).value_code == "lloyd-max"
    with pytest.raises(SystemExit):  # argparse's choices: the flag and its choices in the message
        parse_minima_argv(["--minima-value-code", "lloyd"])
    with pytest.raises(ValueError, match=r"--minima-value-code must be one of \('uniform', 'lloyd-max'\), got 'lmv'"):
        MinimaConfig(value_code="lmv")  # the environment's JSON path
