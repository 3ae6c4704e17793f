"""``scripts/start_fleet.py`` as a user runs it: it starts a master, an instance and a router, the
router serves, and Ctrl-C (SIGINT to the script) stops every process it started: none of them is
left behind. The script is started with SIGINT ignored, as a shell job or ``nohup`` starts it (a
fresh-clone CI run in a background job once timed out here: Python raises KeyboardInterrupt only
when SIGINT was not ignored at start, so the script must install the handler itself)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from needs_mooncake import needs_mooncake  # noqa: E402

needs_mooncake()
pytest.importorskip("sglang_router")
psutil = pytest.importorskip("psutil")

from server_utils import free_port  # noqa: E402
from workloads import random_tokens  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize(
    "shape", [["--instances", "1"], ["--pd", "--prefill", "1", "--decode", "1"]], ids=["instances", "pd"]
)
def test_start_fleet_serves_and_ctrl_c_leaves_nothing_behind(tmp_path, server_factory, shape):
    """Both shapes: one instance behind the router, and a disaggregated fleet (``--pd``: a prefill
    and a decode instance, the router in PD mode)."""
    import random

    from conftest import stop_servers_except

    stop_servers_except("nocache")
    port = free_port()
    log = open(tmp_path / "start_fleet.out", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "scripts", "start_fleet.py"), *shape, "--router-port",
         str(port), "--status-interval", "0", "--log-dir", str(tmp_path), "--segment", "64mb",
         "--", "--k3-checkpoint-dtype", "fp32"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        deadline, ready = time.time() + 300, False
        while time.time() < deadline and proc.poll() is None and not ready:
            time.sleep(1)
            ready = "fleet ready" in (tmp_path / "start_fleet.out").read_text()
        assert ready, (tmp_path / "start_fleet.out").read_text()[-3000:]
        children = _descendants(proc.pid)
        assert len(children) >= 3 + (shape[0] == "--pd")  # master, instances (+ schedulers), router
        ids = random_tokens(random.Random(5), 120)
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
        r = requests.post(
            f"http://127.0.0.1:{port}/generate", json=body, headers={"X-SMG-Routing-Key": "s"}, timeout=120
        )
        assert r.status_code == 200, r.text[:300]
        assert r.json()["output_ids"] == server_factory("nocache").generate(ids, 4)["output_ids"]
        status = subprocess.run(
            [sys.executable, "-m", "sglang_k3.fleet.status", "--router", f"http://127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0 and "127.0.0.1" in status.stdout, status.stderr
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the script
        proc.wait(timeout=120)
        time.sleep(1)
        alive = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/workers", timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in _descendants(proc.pid):
            p.kill()
        log.close()
