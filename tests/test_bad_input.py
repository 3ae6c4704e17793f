"""Bad requests get a clear 4xx and the server keeps serving."""
from __future__ import annotations

import requests


def _assert_still_serving(s):
    assert requests.get(s.url + "/health", timeout=30).status_code == 200
    out = s.generate([65, 66, 67, 68], 2)
    assert len(out["output_ids"]) == 2


def _post(s, body=None, data=None):
    return requests.post(s.url + "/generate", json=body, data=data, timeout=120,
                         headers={"Content-Type": "application/json"})


def test_empty_prompt(server_factory):
    s = server_factory("upstream")
    r = _post(s, {"text": "", "sampling_params": {"max_new_tokens": 4}})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    _assert_still_serving(s)


def test_prompt_longer_than_context(server_factory):
    s = server_factory("upstream")
    ctx = requests.get(s.url + "/get_model_info", timeout=30).json().get("max_context_length") or 16384
    r = _post(s, {"input_ids": [65] * (ctx + 10), "sampling_params": {"max_new_tokens": 4}})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    _assert_still_serving(s)


def test_negative_max_new_tokens(server_factory):
    s = server_factory("upstream")
    r = _post(s, {"text": "hello", "sampling_params": {"max_new_tokens": -1}})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    _assert_still_serving(s)


def test_malformed_json(server_factory):
    s = server_factory("upstream")
    r = _post(s, data=b'{"text": "hello", "sampling_params": {')
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    _assert_still_serving(s)
