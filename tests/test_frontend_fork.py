"""An SGLang frontend-language program with ``fork`` runs against the server; branches hit the cache."""
from __future__ import annotations

import random

import sglang as sgl

from workloads import PRINTABLE

PREFIX_LEN = 200


@sgl.function
def branches(s, prefix, num_branches):
    s += prefix
    forks = s.fork(num_branches)
    for i, f in enumerate(forks):
        f += f" Branch {i} asks:"
        f += sgl.gen("answer", max_tokens=6, temperature=0)
    forks.join()
    return [f.get_meta_info("answer") for f in forks]


def test_fork_program_runs_and_branches_report_cached_tokens(server_factory):
    s = server_factory("upstream")
    rng = random.Random(3)
    prefix = "".join(chr(rng.choice(PRINTABLE)) for _ in range(PREFIX_LEN))
    backend = sgl.RuntimeEndpoint(s.url)
    state = branches.run(prefix=prefix, num_branches=3, backend=backend)
    assert state.error() is None
    metas = state.ret_value
    assert len(metas) == 3
    for m in metas:
        assert m["completion_tokens"] >= 1
        assert m["cached_tokens"] > 0, m
