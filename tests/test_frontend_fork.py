"""An SGLang frontend-language program with ``fork`` runs against the server; branches hit the cache.

The branches of a fork reach the server together, so in the first run only the branches admitted
after the first one can reuse the shared prefix (k3 keeps the state at the 64-token boundary
before the branch point). A second run over the same context, as an agent or a tree search does,
finds the prefix cached for every branch. Upstream's hybrid cache reports 0 cached tokens for
these branches: under no_buffer it keeps no state a branch can resume from.
"""

from __future__ import annotations

import random

import sglang as sgl
from workloads import PRINTABLE

PREFIX_LEN = 200


@sgl.function
def branches(s, prefix, num_branches, label):
    s += prefix
    forks = s.fork(num_branches)
    for i, f in enumerate(forks):
        f += f" {label} {i} asks:"
        f += sgl.gen("answer", max_tokens=6, temperature=0)
    forks.join()
    return [f.get_meta_info("answer") for f in forks]


def test_fork_program_runs_and_branches_report_cached_tokens(server_factory):
    s = server_factory("k3_int8")  # the default server: k3 cache, int8 checkpoints
    s.flush_cache()  # retried: SGLang refuses while the last request is being retired
    rng = random.Random(3)
    prefix = "".join(chr(rng.choice(PRINTABLE)) for _ in range(PREFIX_LEN))
    backend = sgl.RuntimeEndpoint(s.url)
    first = branches.run(prefix=prefix, num_branches=3, label="Branch", backend=backend)
    assert first.error() is None
    assert [m["completion_tokens"] for m in first.ret_value] == [6, 6, 6]
    second = branches.run(prefix=prefix, num_branches=3, label="Option", backend=backend)
    assert second.error() is None
    for m in second.ret_value:
        assert m["completion_tokens"] == 6
        assert m["cached_tokens"] >= 128, m  # the shared 200-token context, up to a chunk boundary
