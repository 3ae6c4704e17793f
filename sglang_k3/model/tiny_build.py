"""Build the embedded tiny model into a directory, or find it in the cache.

``default_model_path()`` is what ``launch_server`` serves when no ``--model-path`` is given. The
directory is named by the spec's fingerprint, built once into a temporary sibling and renamed into
place, so concurrent first starts never see a half-written model.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from sglang_k3.model.tiny_spec import TinyK3Spec

ENV_HOME = "SGLANG_K3_HOME"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def cache_root() -> str:
    return os.environ.get(ENV_HOME) or os.path.join(os.path.expanduser("~"), ".cache", "sglang_k3")


def build(out_dir: str, spec: TinyK3Spec = TinyK3Spec()) -> str:
    """Write config, fp32 safetensors weights and the tokenizer into ``out_dir``."""
    from safetensors.torch import save_file

    from sglang_k3.model.tiny_tokenizer import write_tokenizer
    from sglang_k3.model.tiny_weights import make_weights

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(spec.hf_config(), f, indent=2)
    cfg = spec.hf_config()
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                   "pad_token_id": cfg["pad_token_id"], "do_sample": False}, f, indent=2)
    save_file(make_weights(spec), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out_dir, spec)
    return out_dir


def is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in FILES)


def default_model_path(spec: TinyK3Spec = TinyK3Spec()) -> str:
    """Path of the embedded model for ``spec``, building it on first use."""
    root = cache_root()
    path = os.path.join(root, f"tiny-k3-{spec.fingerprint()}")
    if is_complete(path):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
    try:
        build(tmp, spec)
        try:
            os.rename(tmp, path)
        except OSError:
            if not is_complete(path):  # someone else won the race with a complete build: fine
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path
