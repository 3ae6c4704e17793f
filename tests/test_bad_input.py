"""Bad requests get a clear 4xx and the server keeps serving."""

from __future__ import annotations

import pytest
import requests

from sglang_k3.model.tiny_spec import TinyK3Spec


def _assert_still_serving(s):
    assert requests.get(s.url + "/health", timeout=30).status_code == 200
    out = s.generate([65, 66, 67, 68], 2)
    assert len(out["output_ids"]) == 2


def _post(s, body=None, data=None):
    return requests.post(
        s.url + "/generate", json=body, data=data, timeout=120, headers={"Content-Type": "application/json"}
    )


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


# The servers serve the embedded model: its embedding table has VOCAB rows.
VOCAB = TinyK3Spec().vocab_size
OUT_OF_VOCAB = {"far past the table": 10**7, "negative": -5, "equal to the vocab size": VOCAB}


def _assert_names_bad_id(r, bad):
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert str(bad) in r.text and f"[0, {VOCAB})" in r.text, r.text[:500]


@pytest.mark.parametrize("bad", list(OUT_OF_VOCAB.values()), ids=list(OUT_OF_VOCAB))
def test_out_of_vocab_input_id(server_factory, bad):
    s = server_factory("upstream")
    r = _post(s, {"input_ids": [72, bad, 105], "sampling_params": {"max_new_tokens": 8}})
    _assert_names_bad_id(r, bad)
    _assert_still_serving(s)


def test_last_vocab_id_is_served(server_factory):
    s = server_factory("upstream")
    assert len(s.generate([72, VOCAB - 1, 105], 2)["output_ids"]) == 2


def test_out_of_vocab_id_in_a_batch(server_factory):
    s = server_factory("upstream")
    r = _post(s, {"input_ids": [[72, 73, 74], [72, 10**7]], "sampling_params": {"max_new_tokens": 4}})
    _assert_names_bad_id(r, 10**7)
    _assert_still_serving(s)


def test_out_of_vocab_id_in_openai_completion(server_factory):
    s = server_factory("upstream")
    model = requests.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    r = requests.post(
        s.url + "/v1/completions", json={"model": model, "prompt": [72, -5, 105], "max_tokens": 4}, timeout=120
    )
    _assert_names_bad_id(r, -5)
    _assert_still_serving(s)


def test_out_of_vocab_id_on_k3_server(server_factory):
    s = server_factory("k3")
    r = _post(s, {"input_ids": [72, 10**7, 105], "sampling_params": {"max_new_tokens": 8}})
    _assert_names_bad_id(r, 10**7)
    _assert_still_serving(s)
