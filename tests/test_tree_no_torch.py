"""The cache package, and the tiers' torch-free modules, must import and work with torch (and
sglang) unavailable."""

import subprocess
import sys

CODE = r"""
import sys
sys.modules['torch'] = None
sys.modules['sglang'] = None
import sglang_k3.cache as c
import importlib, pkgutil
mods = [m.name for m in pkgutil.iter_modules(c.__path__)]
assert {'tree', 'registry', 'retention', 'lifecycle', 'tier_bridge', 'actions', 'ports', 'build'} <= set(mods), mods
for m in mods:  # every module of the package
    importlib.import_module('sglang_k3.cache.' + m)
t = c.K3RadixTree(num_groups=2)
r = t.insert(list(range(128)), list(range(128)))
t.add_checkpoint(r.node, 64, [1, 2], 8, ready=True)
assert t.match_prefix(list(range(100))).restore_len == 64
for m in ('codec', 'keys', 'ports', 'manager', 'host_store'):  # the tiers' torch-free modules
    importlib.import_module('sglang_k3.tiers.' + m)
from sglang_k3.tiers import codec
blob = codec.encode('k', codec.BOUNDARY, 3, b'S' * 5, b'K' * 6, 3)  # sealed with the host's k3sum64
assert codec.decode('k', blob, 2, 5).kv == b'K' * 6
assert 'torch' not in {k for k, v in sys.modules.items() if v is not None}
print('ok')
"""


def test_imports_and_runs_without_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
