"""Bad input over HTTP against the real server: every case answers as docs/results/reliability/
bad_input.md records (a 400 with a message, or a 200 where SGLang's answer is acceptable), the
server still serves a normal /generate after each, and nothing is left behind."""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minima_test_support.idle import assert_idle

pytestmark = pytest.mark.e2e

VOCAB = 49152  # SmolLM2-135M
CONTEXT = 8192
LONG = "hello " * 9000  # ~9000 tokens: longer than the context
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": "default", "prompt": "hi", "max_tokens": 4}
SP = {"max_new_tokens": 4}


def _gen(**fields) -> dict:
    return {"text": "hi", "sampling_params": SP, **fields}


# (case id, path, body: bytes sent as is or an object sent as JSON, status, text the answer must contain)
CASES = [
    # /generate
    ("gen-malformed-json", "/generate", b'{"text": "hi",', 400, "JSON decode error"),
    ("gen-body-is-a-list", "/generate", b"[1, 2]", 400, "Input should be a dictionary"),
    ("gen-body-is-null", "/generate", b"null", 400, "Input should be a dictionary"),
    ("gen-empty-body", "/generate", b"", 400, "Field required"),
    ("gen-text-is-a-number", "/generate", {"text": 123}, 400, "Input should be a valid string"),
    ("gen-sampling-params-is-a-string", "/generate", _gen(sampling_params="abc"), 400, "validation error"),
    ("gen-max-new-tokens-is-a-string", "/generate", _gen(sampling_params={"max_new_tokens": "ten"}), 400,
     "expected i64"),
    ("gen-max-new-tokens-negative", "/generate", _gen(sampling_params={"max_new_tokens": -1}), 400,
     "max_new_tokens must be at least 0"),
    ("gen-max-new-tokens-zero", "/generate", _gen(sampling_params={"max_new_tokens": 0}), 200, '"output_ids":[]'),
    ("gen-max-new-tokens-huge", "/generate", _gen(sampling_params={"max_new_tokens": 10**9}), 400,
     f"maximum context length of {CONTEXT} tokens"),
    ("gen-max-new-tokens-beyond-i64", "/generate", _gen(sampling_params={"max_new_tokens": 10**30}), 400,
     "expected i64"),
    ("gen-max-new-tokens-float", "/generate", _gen(sampling_params={"max_new_tokens": 2.5}), 400, "expected i64"),
    ("gen-empty-text", "/generate", _gen(text=""), 400, "The prompt has no tokens"),
    ("gen-batch-with-an-empty-text", "/generate", _gen(text=["hi", ""]), 400, "The prompt has no tokens"),
    ("gen-empty-input-ids", "/generate", {"input_ids": [], "sampling_params": SP}, 400, "input_ids cannot be empty"),
    ("gen-no-prompt", "/generate", {"sampling_params": SP}, 400, "Either text, input_ids or input_embeds"),
    ("gen-text-longer-than-context", "/generate", _gen(text=LONG), 400, "longer than the model's context length"),
    ("gen-ids-longer-than-context", "/generate", {"input_ids": [1] * 9000, "sampling_params": SP}, 400,
     "The input (9000 tokens) is longer than the model's context length"),
    ("gen-prompt-plus-new-tokens-beyond-context", "/generate",
     {"input_ids": [1] * 8190, "sampling_params": {"max_new_tokens": 100}}, 400, "8190 tokens from the input"),
    ("gen-negative-input-id", "/generate", {"input_ids": [-1, 5], "sampling_params": SP}, 400,
     f"token id -1 outside the vocabulary [0, {VOCAB})"),
    ("gen-input-id-equal-to-vocab", "/generate", {"input_ids": [VOCAB, 5], "sampling_params": SP}, 400,
     f"token id {VOCAB} outside the vocabulary"),
    ("gen-input-id-huge", "/generate", {"input_ids": [10**12], "sampling_params": SP}, 400, "outside the vocabulary"),
    ("gen-batch-with-a-bad-id", "/generate", {"input_ids": [[5], [-3]], "sampling_params": SP}, 400,
     "token id -3 outside the vocabulary"),
    ("gen-input-id-is-a-string", "/generate", {"input_ids": ["a"], "sampling_params": SP}, 400,
     "elements must be int or list"),
    ("gen-input-id-is-a-float", "/generate", {"input_ids": [1.5], "sampling_params": SP}, 400,
     "elements must be int or list"),
    ("gen-temperature-nan", "/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": NaN}}',
     400, "JSON decode error"),
    ("gen-temperature-infinity", "/generate",
     b'{"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": Infinity}}', 400, "JSON decode error"),
    ("gen-temperature-overflows-to-inf", "/generate",
     b'{"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 1e999}}', 400, "number is infinity"),
    ("gen-temperature-negative", "/generate", _gen(sampling_params={"max_new_tokens": 4, "temperature": -1}), 400,
     "temperature must be a non-negative finite number"),
    ("gen-temperature-is-a-string", "/generate", _gen(sampling_params={"max_new_tokens": 4, "temperature": "hot"}),
     400, "expected f64"),
    ("gen-top-p-above-one", "/generate", _gen(sampling_params={"max_new_tokens": 4, "top_p": 2}), 400,
     "top_p must be in (0, 1]"),
    ("gen-stream-is-a-string", "/generate", _gen(stream="yes"), 400, "expected a boolean"),
    ("gen-unknown-top-level-field", "/generate", _gen(bogus_field=1), 200, '"completion_tokens":4'),
    ("gen-unknown-sampling-param", "/generate", _gen(sampling_params={"max_new_tokens": 4, "bogus_param": 1}), 400,
     "unknown field `bogus_param`"),
    # /v1/completions
    ("cmpl-malformed-json", "/v1/completions", b'{"model": "default", "prompt": "hi",', 400, "JSON decode error"),
    ("cmpl-prompt-is-a-number", "/v1/completions", {**COMP, "prompt": 123}, 400, "validation errors"),
    ("cmpl-max-tokens-negative", "/v1/completions", {**COMP, "max_tokens": -1}, 400, "max_tokens must be positive"),
    ("cmpl-max-tokens-zero", "/v1/completions", {**COMP, "max_tokens": 0}, 400, "max_tokens must be positive"),
    ("cmpl-max-tokens-huge", "/v1/completions", {**COMP, "max_tokens": 10**9}, 400, "maximum context length"),
    ("cmpl-max-tokens-is-a-string", "/v1/completions", {**COMP, "max_tokens": "ten"}, 400,
     "Input should be a valid integer"),
    ("cmpl-empty-prompt", "/v1/completions", {**COMP, "prompt": ""}, 400, "Prompt cannot be empty"),
    ("cmpl-empty-id-prompt", "/v1/completions", {**COMP, "prompt": []}, 400, "Prompt cannot be empty"),
    ("cmpl-batch-with-an-empty-prompt", "/v1/completions", {**COMP, "prompt": ["hi", ""]}, 400,
     "The prompt has no tokens"),
    ("cmpl-prompt-longer-than-context", "/v1/completions", {**COMP, "prompt": LONG}, 400,
     "longer than the model's context length"),
    ("cmpl-negative-id", "/v1/completions", {**COMP, "prompt": [-1, 5]}, 400, "token id -1 outside the vocabulary"),
    ("cmpl-id-beyond-vocab", "/v1/completions", {**COMP, "prompt": [VOCAB]}, 400, "outside the vocabulary"),
    ("cmpl-temperature-nan", "/v1/completions",
     b'{"model": "default", "prompt": "hi", "max_tokens": 4, "temperature": NaN}', 400, "JSON decode error"),
    ("cmpl-temperature-negative", "/v1/completions", {**COMP, "temperature": -1}, 400,
     "temperature must be a non-negative finite number"),
    ("cmpl-unknown-field", "/v1/completions", {**COMP, "bogus": 1}, 200, '"completion_tokens":4'),
    ("cmpl-no-model", "/v1/completions", {"prompt": "hi", "max_tokens": 4}, 200, '"completion_tokens":4'),
    # /v1/chat/completions
    ("chat-malformed-json", "/v1/chat/completions", b'{"model": "default", "messages": [', 400, "JSON decode error"),
    ("chat-messages-is-a-string", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 400,
     "Input should be a valid list"),
    ("chat-no-messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "Messages cannot be empty"),
    ("chat-empty-content", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": ""}]}, 200,
     '"role":"assistant"'),
    ("chat-content-is-a-number", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]},
     400, "validation errors"),
    ("chat-unknown-role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "validation errors"),
    ("chat-message-without-role", "/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]}, 400,
     "Field required"),
    ("chat-max-tokens-negative", "/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400,
     "max_new_tokens must be at least 0"),
    ("chat-max-tokens-huge", "/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, 400, "maximum context length"),
    ("chat-content-longer-than-context", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": LONG}]}, 400, "longer than the model's context length"),
    ("chat-n-zero", "/v1/chat/completions", {**CHAT, "n": 0}, 400, "range() arg 3 must not be zero"),
    ("chat-temperature-nan", "/v1/chat/completions",
     b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": NaN}',
     400, "JSON decode error"),
    ("chat-temperature-negative", "/v1/chat/completions", {**CHAT, "temperature": -1}, 400,
     "temperature must be a non-negative finite number"),
    ("chat-unknown-field", "/v1/chat/completions", {**CHAT, "bogus": 1}, 200, '"role":"assistant"'),
]


def _post(url: str, path: str, body) -> requests.Response:
    if isinstance(body, bytes):
        return requests.post(url + path, data=body, headers={"Content-Type": "application/json"}, timeout=120)
    return requests.post(url + path, json=body, timeout=120)


def _still_serving(url: str) -> None:
    r = requests.post(url + "/generate", json={
        "text": "The capital of France is", "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }, timeout=120)
    assert r.status_code == 200, r.text[:500]
    out = r.json()  # greedy: " Paris" is the first token
    assert out["meta_info"]["completion_tokens"] == 2 and "Paris" in out["text"], out


def _error_message(r: requests.Response) -> str:
    """SGLang answers errors in three shapes: {"error": str}, {"error": {"message"}}, {"message"}."""
    body = r.json()
    err = body.get("error", body)
    return err if isinstance(err, str) else err.get("message", "")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_answered_and_the_server_keeps_serving(default_server, case):
    _, path, body, status, text = case
    r = _post(default_server.url, path, body)
    assert r.status_code == status, r.text[:500]
    if status >= 400:
        assert text in _error_message(r), r.text[:500]
    else:
        assert text in r.text, r.text[:500]
    _still_serving(default_server.url)


def test_nothing_is_left_behind_after_the_bad_input_cases(default_server):
    # Runs after the cases above (file order): none of them left a request or a page behind.
    assert_idle(default_server.url)


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
_SAMPLING = st.fixed_dictionaries(
    # max_new_tokens is always set (possibly to a bad value): a valid body then decodes at most 3 tokens.
    {"max_new_tokens": st.integers(-3, 3) | st.sampled_from([2**31, 2**63 - 1]) | st.floats(-2, 2) | _ANY},
    optional={
        "temperature": st.floats(-2, 1e6, allow_nan=False) | _ANY,
        "top_p": st.floats(-1, 2, allow_nan=False),
        "top_k": st.integers(-5, 10**6),
        "min_p": st.floats(-1, 2, allow_nan=False),
        "frequency_penalty": st.floats(-5, 5, allow_nan=False),
        "repetition_penalty": st.floats(-1, 3, allow_nan=False),
        "min_new_tokens": st.integers(-3, 3),
        "stop": _ANY,
    },
)
_PROMPT_IDS = st.lists(st.integers(-3, VOCAB + 3) | st.sampled_from([0, VOCAB - 1, -(2**40), 2**40]), max_size=6)
_GENERATE_BODY = st.fixed_dictionaries(
    {"sampling_params": _SAMPLING},
    optional={"text": st.text(max_size=12) | _ANY, "input_ids": _PROMPT_IDS | _ANY, "stream": _ANY,
              "rid": _ANY, "bogus": _ANY},
)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(body=_GENERATE_BODY | _ANY)
def test_random_generate_bodies_get_a_200_or_a_400_with_a_message(default_server, body):
    r = _post(default_server.url, "/generate", json.dumps(body).encode())
    assert r.status_code in (200, 400), (body, r.status_code, r.text[:500])
    if r.status_code == 400:
        assert _error_message(r), (body, r.text[:500])


def test_server_is_idle_and_serving_after_the_random_bodies(default_server):
    _still_serving(default_server.url)
    assert_idle(default_server.url)
