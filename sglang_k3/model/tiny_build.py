"""Build the embedded tiny model into a directory, or find it (verified) in the cache.

``default_model_path()`` is what ``launch_server`` serves when no ``--model-path`` is given. The
directory is named by the spec's fingerprint and holds a manifest (each file's size and sha256,
the spec with its seed, the builder version), checked on every use: a directory that fails the
check (a deleted tokenizer, a truncated weight file, an interrupted copy) is rebuilt, with a
one-line message saying why. A build goes into a temporary sibling that is renamed into place, so
concurrent first starts never see a half-written model; the temporary directory is removed even
when the build fails, and one left by a killed process is removed by the next start.
Directories are 0755 and files 0644, so a shared cache is readable by every user (the model is
random weights: nothing in it is private).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import uuid

from sglang_k3.model.tiny_spec import BUILDER_VERSION, TinyK3Spec

ENV_HOME = "SGLANG_K3_HOME"
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
MANIFEST = "manifest.json"
# Siblings of the model directory: a build in progress (named by its builder's pid, so a later
# start can tell a live build from one whose process was killed), a broken directory moved aside
# to be deleted, and the lock that installs a build.
BUILDING_PREFIX = ".building-"
DISCARD_PREFIX = ".discard-"
LOCK = ".install.lock"  # kept: deleting a lock file others may be waiting on would break the lock
DIR_MODE = 0o755
FILE_MODE = 0o644


def cache_root() -> str:
    return os.environ.get(ENV_HOME) or os.path.join(os.path.expanduser("~"), ".cache", "sglang_k3")


def build(out_dir: str, spec: TinyK3Spec = TinyK3Spec()) -> str:
    """Write config, fp32 safetensors weights, the tokenizer and the manifest into ``out_dir``."""
    from safetensors.torch import save_file

    from sglang_k3.model.tiny_tokenizer import write_tokenizer
    from sglang_k3.model.tiny_weights import make_weights

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(spec.hf_config(), f, indent=2)
    cfg = spec.hf_config()
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(
            {
                "bos_token_id": cfg["bos_token_id"],
                "eos_token_id": cfg["eos_token_id"],
                "pad_token_id": cfg["pad_token_id"],
                "do_sample": False,
            },
            f,
            indent=2,
        )
    save_file(make_weights(spec), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out_dir, spec)
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest_of(out_dir, spec), f, indent=2)
    for name in FILES + (MANIFEST,):  # safetensors writes its file 0600
        os.chmod(os.path.join(out_dir, name), FILE_MODE)
    return out_dir


def _header(spec: TinyK3Spec) -> dict:
    """What a build of ``spec`` must have been made from; a manifest that differs is stale."""
    return {
        "builder_version": BUILDER_VERSION,
        "fingerprint": spec.fingerprint(),
        "seed": spec.seed,
        "spec": dataclasses.asdict(spec),
    }


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_of(model_dir: str, spec: TinyK3Spec) -> dict:
    """The manifest of the files in ``model_dir`` as they are now, for a build of ``spec``."""
    files = {}
    for name in FILES:
        p = os.path.join(model_dir, name)
        files[name] = {"size": os.path.getsize(p), "sha256": _sha256(p)}
    return {**_header(spec), "files": files}


def verify(model_dir: str, spec: TinyK3Spec = TinyK3Spec()) -> str | None:
    """Why ``model_dir`` is not an intact build of ``spec``, or None when it is."""
    if not os.path.isdir(model_dir):
        return "it does not exist"
    try:
        with open(os.path.join(model_dir, MANIFEST)) as f:
            recorded = json.load(f)
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    header = _header(spec)
    if not isinstance(recorded, dict) or {k: recorded.get(k) for k in header} != header:
        return f"{MANIFEST} is for another spec, seed or builder version"
    files = recorded.get("files")
    if not isinstance(files, dict) or sorted(files) != sorted(FILES):
        return f"{MANIFEST} does not list the model's files"
    for name in FILES:
        problem = _file_problem(os.path.join(model_dir, name), files[name])
        if problem:
            return f"{name} {problem}"
    return None


def _file_problem(path: str, entry: dict) -> str | None:
    if not os.path.isfile(path):
        return "is missing"
    size = os.path.getsize(path)
    if size != entry.get("size"):
        return f"has {size} bytes, the manifest says {entry.get('size')}"
    if _sha256(path) != entry.get("sha256"):
        return "does not match its sha256 in the manifest"
    return None


def default_model_path(spec: TinyK3Spec = TinyK3Spec()) -> str:
    """Path of the embedded model for ``spec``, verified; built (or rebuilt) when it fails verification."""
    root = cache_root()
    path = os.path.join(root, f"tiny-k3-{spec.fingerprint()}")
    os.makedirs(root, exist_ok=True)
    _remove_leftovers(root)
    problem = verify(path, spec)
    if problem is None:
        return path
    verb = "rebuilding" if os.path.lexists(path) else "building"
    print(f"sglang-k3: {verb} the embedded model in {path} ({problem})", file=sys.stderr)
    _build_and_install(root, path, spec)
    return path


def _remove_leftovers(root: str) -> None:
    """Delete build directories whose process is gone (killed mid-build) and directories moved
    aside for deletion, so a crash never leaves debris that a later start trips over."""
    for name in os.listdir(root):
        stale_build = name.startswith(BUILDING_PREFIX) and not _builder_alive(name)
        if stale_build or name.startswith(DISCARD_PREFIX):
            _remove(os.path.join(root, name))


def _builder_alive(name: str) -> bool:
    """Whether the process named in a ``.building-<pid>-<token>`` directory still runs on this host
    (a name without a pid, e.g. from an older builder, belongs to nobody)."""
    pid = name[len(BUILDING_PREFIX) :].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _build_and_install(root: str, path: str, spec: TinyK3Spec) -> None:
    tmp = os.path.join(root, f"{BUILDING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    os.chmod(tmp, DIR_MODE)  # renamed into place as is
    try:
        build(tmp, spec)
        _install(tmp, path, spec)
    finally:
        _remove(tmp)  # a failed build's files; nothing once the rename has happened


def _install(tmp: str, path: str, spec: TinyK3Spec) -> None:
    """Rename the finished build ``tmp`` to ``path``, holding the install lock so that concurrent
    starts take turns: if a valid build is already there (another start won), ours is dropped;
    a broken one is moved aside and deleted first. Without the lock, a start could move aside a
    valid build that another start had installed since it last looked."""
    fd = os.open(os.path.join(os.path.dirname(path), LOCK), os.O_RDONLY | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if verify(path, spec) is None:
            return
        _discard(path)
        os.rename(tmp, path)
    finally:
        os.close(fd)  # releases the lock


def _discard(path: str) -> None:
    """Move ``path`` (if any) out of the way in one atomic step, then delete it."""
    aside = os.path.join(os.path.dirname(path), f"{DISCARD_PREFIX}{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    _remove(aside)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
