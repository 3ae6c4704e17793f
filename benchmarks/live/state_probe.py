"""State probes: judge a restore by the state it put in the request's slot, not only by the tokens.

A first-token logprob cannot tell a wrong restore from bf16 noise on a GPU (GPU_NOTES, fifth
session: a negated state drifted 1.3x the floor of 16 requests). The state itself can: a restore is
right when the state it leaves is the one a cache-off server computes for the same tokens, to within
what two cache-off servers that split the prefill differently disagree by, plus what the checkpoint
codec loses by design (int8: one scale per layer, head and k-channel; bf16: the cast).

How the states are read: every server the harness starts gets ``tests/faults/sitecustomize.py``
first on ``PYTHONPATH`` and ``SGLANG_K3_TEST_STATE_DIR`` set. A k3 server then writes each state it
restores (``restore-NNNNN.pt``, in restore order; the harness sends one request at a time, so the
files a request adds are its own), and any server writes the state of a request whose ``rid`` starts
with ``k3state-`` when SGLang releases it (``final-RID.pt``). Sent with ``max_new_tokens`` 0 (a
prefill-only request: no decode step, overlap scheduling or not), that is the state after exactly
the tokens sent.

Per restored request (restore point ``B`` = its ``cached_tokens``), the reference and the split
server prefill ``prompt[:B]`` alone, and the reference again in a batch: **state drift** =
``max(|dT| / |T|, |dC| / |C|)`` over every KDA layer (T the recurrent state, C the conv windows,
Frobenius norms in float64), against the reference's state. A request's floor is its split drift plus
its batch drift plus the codec's own loss on the reference state; :func:`benchmarks.noise_differential.judge`
flags a restore past ``FLAG_FACTOR`` times the largest floor of the candidate's restores.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS_DIR = os.path.join(REPO, "tests", "faults")
PROBE_PREFIX = "k3state-"  # tests/faults/sitecustomize.py's PROBE_PREFIX
STATE_DIR_ENV = "SGLANG_K3_TEST_STATE_DIR"


def available() -> bool:
    """The probe hooks ship with a source checkout only."""
    return os.path.isfile(os.path.join(FAULTS_DIR, "sitecustomize.py"))


def hooks_env(env: dict | None = None) -> dict:
    """``env`` with ``tests/faults`` first on ``PYTHONPATH`` (once), so a server started with it
    loads the hooks of ``tests/faults/sitecustomize.py``."""
    out = dict(env or {})
    path = out.get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")
    if FAULTS_DIR not in path.split(os.pathsep):
        path = FAULTS_DIR + (os.pathsep + path if path else "")
    out["PYTHONPATH"] = path
    return out


def server_env(root: str, name: str, env: dict | None) -> dict:
    """``env`` plus what makes server ``name`` write its states under ``root/name`` (emptied)."""
    d = os.path.join(root, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return {**hooks_env(env), STATE_DIR_ENV: d}


class RestoreLog:
    """The ``restore-*.pt`` files of one server's folder, handed out as they appear."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.seen: set = set()

    def new(self) -> list[str]:
        files = sorted(glob.glob(os.path.join(self.folder, "restore-*.pt")))
        fresh = [f for f in files if f not in self.seen]
        self.seen.update(fresh)
        return fresh


def load(path: str) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _rel(a, b) -> float:
    """|a - b| / |b| in float64 (0 when both are 0; inf when only ``b`` is)."""
    import torch

    a, b = a.to(torch.float64), b.to(torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"state shapes differ: {tuple(a.shape)} against {tuple(b.shape)}")
    num, den = torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def _conv(state: dict):
    import torch

    return torch.cat([c.reshape(-1).to(torch.float64) for c in state["conv"]]) if state["conv"] else None


def state_drift(got: dict, ref: dict) -> dict:
    """``{"temporal", "conv", "drift"}``: relative distances of ``got``'s state to ``ref``'s."""
    t = _rel(got["temporal"], ref["temporal"])
    cg, cr = _conv(got), _conv(ref)
    c = _rel(cg, cr) if cr is not None else 0.0
    return {"temporal": t, "conv": c, "drift": max(t, c)}


def codec_loss(ref: dict, dtype: str) -> float:
    """What the checkpoint codec itself loses on ``ref``'s recurrent state (conv windows are kept in
    the pool's dtype): int8 through the kernels' own torch reference (``kernels.ckpt.reference``),
    bf16 by the cast, fp32 nothing."""
    import torch

    t = ref["temporal"]
    if dtype == "int8":
        from kernels.ckpt.reference import dequantize_tile, quantize_tile

        back = dequantize_tile(*quantize_tile(t))  # [L, H, V, K]: scales over V, as stored
    elif dtype == "bf16":
        back = t.to(torch.bfloat16).to(torch.float32)
    elif dtype == "fp32":
        return 0.0
    else:
        raise ValueError(f"unknown checkpoint dtype {dtype!r}")
    return _rel(back, t.to(torch.float32))


def _final(folder: str, rid: str, timeout: float = 30.0) -> dict:
    """The state a server wrote for ``rid``; it is written before the answer leaves the scheduler,
    but the folder is polled briefly in case a file system lags."""
    path = os.path.join(folder, f"final-{rid}.pt")
    end = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > end:
            raise RuntimeError(f"no state written for {rid} in {folder}: is the probe hook loaded?")
        time.sleep(0.05)
    return load(path)


def reference_states(points: list, prompts: dict, servers: dict, folders: dict, batch_size: int, seed: int) -> dict:
    """``points``: distinct ``(key, B)`` restore points. Prefills ``prompts[key][:B]`` on the
    reference and split servers one at a time, and on the reference again in concurrent batches of
    ``batch_size`` (shuffled with ``seed``). Returns ``{(key, B): {"reference", "split", "batch"}}``
    of loaded states."""
    import random

    out: dict = {p: {} for p in points}

    def probe(server: str, tag: str, i: int, point) -> tuple:
        key, b = point
        rid = f"{PROBE_PREFIX}{tag}{i}-{b}"
        servers[server].generate(prompts[key][:b], 0, rid=rid)
        return point, _final(folders[server], rid)

    for name in ("reference", "split"):
        for i, p in enumerate(points):
            out[p][name] = probe(name, name[0], i, p)[1]
    order = list(enumerate(points))
    random.Random(seed * 7919 + 2).shuffle(order)
    with ThreadPoolExecutor(batch_size) as ex:
        for b in range(0, len(order), batch_size):
            chunk = order[b : b + batch_size]
            for p, st in ex.map(lambda ip: probe("reference", "b", ip[0], ip[1]), chunk):
                out[p]["batch"] = st
    return out


def judge_states(restores: list, refs: dict, dtype: str, judge) -> dict:
    """``restores``: ``[{"key", "cached_tokens", "file"}]`` of one candidate's restored requests;
    ``refs``: :func:`reference_states`' result; ``judge``: the harness's verdict function. Returns
    the verdict plus every request's drifts and floor terms."""
    rows, cand, floors = [], [], []
    for r in restores:
        ref = refs[(r["key"], r["cached_tokens"])]
        got = load(r["file"])
        d = state_drift(got, ref["reference"])
        split = state_drift(ref["split"], ref["reference"])["drift"]
        batch = state_drift(ref["batch"], ref["reference"])["drift"]
        codec = codec_loss(ref["reference"], dtype)
        floor = split + batch + codec
        rows.append({**r, "file": os.path.basename(r["file"]), **d, "split": split, "batch": batch, "codec": codec})
        cand.append((r["key"], d["drift"]))
        floors.append(floor)
    if not cand:
        return {"restored_requests": 0, "within_floor": False, "requests": rows}
    v = judge(cand, floors)
    v.pop("mann_whitney_p", None)
    v.pop("stochastically_larger", None)
    return {**v, "codec": dtype, "requests": rows}
