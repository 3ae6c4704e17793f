"""The server handle (:class:`sglang_k3.fleet.instance.Server`) survives losing a port race at
start: a port it picked free is taken before the server binds it. A fresh-clone CI run once failed
this way: two servers booting together in ``benchmarks.overlap_ab``, one scheduler's rendezvous
port (SGLang picks it at random below the ephemeral range) already in use when it bound it.

Here the handle's HTTP port is taken by a listening socket before launch, which is the same race
made certain: the start must be retried on a fresh port and serve. A start that fails for any other
reason is not retried."""

from __future__ import annotations

import random
import socket

from server_utils import Server, ServerStartError
from workloads import random_tokens

from sglang_k3.fleet.instance import log_shows_port_clash


def test_port_clash_is_found_above_a_long_traceback(tmp_path):
    log = tmp_path / "server.log"
    lines = ["[2026-12-02 09:35:47] ERROR:    [Errno 98] error while attempting to bind on address "]
    lines[0] += "('127.0.0.1', 45557): address already in use"
    lines += [f"  File 'x.py', line {i}, in f" for i in range(200)]
    log.write_text("\n".join(lines))
    assert log_shows_port_clash(str(log))
    log.write_text("\n".join(lines[1:] + ["ValueError: --k3-checkpoint-dtype must be int8 or fp32"]))
    assert not log_shows_port_clash(str(log))
    assert not log_shows_port_clash(str(tmp_path / "missing.log"))


def test_a_taken_port_at_start_is_retried_on_a_fresh_one(tmp_path):
    srv = Server("port_clash", [], log_dir=str(tmp_path))
    taken = srv.port
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", taken))
    holder.listen()
    try:
        srv.start()
        assert srv.port_clashes == 1
        assert srv.port != taken
        out = srv.generate(random_tokens(random.Random(0), 24), 4)
        assert len(out["output_ids"]) == 4
    finally:
        srv.stop()
        holder.close()


def test_a_start_failing_for_another_reason_is_not_retried(tmp_path):
    srv = Server("bad_flag", ["--k3-checkpoint-dtype", "int3"], log_dir=str(tmp_path))
    try:
        srv.start()
    except ServerStartError as e:
        assert "int3" in str(e)
    else:
        srv.stop()
        raise AssertionError("a server with --k3-checkpoint-dtype int3 started")
    assert srv.port_clashes == 0
