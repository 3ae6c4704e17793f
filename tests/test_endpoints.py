"""The HTTP surface users rely on, against a real server with upstream's hybrid cache."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import requests
from workloads import random_tokens


def test_health_model_info_server_info(server_factory):
    s = server_factory("upstream")
    assert requests.get(s.url + "/health", timeout=30).status_code == 200
    info = requests.get(s.url + "/get_model_info", timeout=30).json()
    assert "tiny-k3-" in info["model_path"]
    srv = requests.get(s.url + "/server_info", timeout=30).json()
    assert srv["dtype"] == "float32" or "float32" in json.dumps(srv)


def test_extended_prompt_reports_cached_tokens_and_flush_drops_them(server_factory):
    s = server_factory("upstream")
    s.flush_cache()  # retried: SGLang refuses while the last request is being retired
    ids = random_tokens(random.Random(99), 150)
    first = s.generate(ids, 4)
    assert first["meta_info"]["cached_tokens"] == 0
    extended = s.generate(ids + first["output_ids"] + random_tokens(random.Random(100), 30), 4)
    assert extended["meta_info"]["cached_tokens"] > 0
    # After a flush nothing is cached any more.
    s.flush_cache()  # retried: SGLang refuses while the last request is being retired
    again = s.generate(ids + first["output_ids"] + random_tokens(random.Random(100), 30), 4)
    assert again["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == extended["output_ids"]


def test_openai_completions_and_chat(server_factory):
    s = server_factory("upstream")
    model = requests.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The cache says", "max_tokens": 6, "temperature": 0}
    r = requests.post(s.url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    body = r.json()
    assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["text"] is not None
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, "temperature": 0}
    r = requests.post(s.url + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    chat = r.json()
    assert chat["choices"][0]["message"]["role"] == "assistant"
    # "<|user|>hello there<|sep|><|assistant|>": 3 special tokens + 11 bytes.
    assert chat["usage"]["prompt_tokens"] == 14


def test_bench_serving_generated_shared_prefix(server_factory, embedded_model_dir, tmp_path):
    s = server_factory("upstream")
    out = tmp_path / "bench.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang",
        "--base-url",
        s.url,
        "--dataset-name",
        "generated-shared-prefix",
        "--tokenizer",
        embedded_model_dir,
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "3",
        "--gsp-system-prompt-len",
        "160",
        "--gsp-question-len",
        "24",
        "--gsp-output-len",
        "6",
        "--num-prompts",
        "6",
        "--output-file",
        str(out),
        "--seed",
        "5",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["completed"] == 6
    assert rec["total_output_tokens"] > 0
