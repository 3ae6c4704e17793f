"""Lower tiers in the replay: the server's own tier manager, keys, object format and host store
(:mod:`sglang_k3.tiers`), with object sizes modelled instead of materialised.

``--host-budget-gib`` and ``--l3-budget-gib`` give the ``k3`` policies a host tier and a Mooncake
(L3) tier. Every boundary the device evicts goes to both, as the server writes it; an admission
brings back the deepest complete one. What is modelled:

* **Bytes.** Objects carry an empty payload; each store charges what the object would hold: a KV
  block one symbol of MLA KV, a boundary one checkpoint in the policy's dtype plus its tail KV
  (:class:`ModelledStore`). Budgets, LRU order and refusals are the real store's.
* **L3** is a second LRU store of its own budget (Mooncake evicts approximately LRU at a high
  watermark; ``MOONCAKE`` notes in ``../shared/notes``), shared by nobody else in the replay.
* **Time.** Loading a boundary adds its bytes over the tier's link to the request's TTFT
  (``--host-gbps``, default 55: the H200's measured pinned host-to-device rate in
  ``benchmarks/GPU_NOTES.md``; ``--l3-gbps``, default 12.5: one 100 Gb/s RDMA NIC, an
  assumption, not a measurement). Saves are not charged (they run after the forward, off the
  critical path).
"""

from __future__ import annotations

from typing import Optional, Sequence

from sglang_k3.kernels.tier import k3sum64
from sglang_k3.tiers import codec
from sglang_k3.tiers.host_store import HostStore
from sglang_k3.tiers.keys import Namespace
from sglang_k3.tiers.manager import TierManager


class SimTierIO:
    """Moves nothing: the replay has no tensors. Sizes are charged by :class:`ModelledStore`."""

    kv_token_bytes = 0
    state_bytes = 0
    layout = "replay"

    def read_payloads(self, parts, outs: Sequence[memoryview]):
        return lambda: [k3sum64(o) for o in outs]  # the objects' (empty) payloads, as a server checks them

    def load_payloads(self, payloads, checks, kv_spans, new_kv, state_span, handle) -> Optional[bool]:
        return True if [k3sum64(p) for p in payloads] == list(checks) else None


class ModelledStore(HostStore):
    recycles = False  # its objects are headers; the budget is in modelled bytes

    def __init__(self, budget_bytes: int, name: str, kv_symbol_bytes: int, state_bytes: int) -> None:
        super().__init__(budget_bytes, name)
        self.kv_symbol_bytes, self.state_bytes = kv_symbol_bytes, state_bytes

    def charge(self, blob: bytes) -> int:
        kind, _, kv_symbols = codec.peek(blob)
        return (self.state_bytes if kind == codec.BOUNDARY else 0) + kv_symbols * self.kv_symbol_bytes

    def state_charge(self, blob: bytes) -> int:
        return self.state_bytes if codec.peek(blob)[0] == codec.BOUNDARY else 0


def build_sim_tiers(
    cfg, checkpoint_bytes: int, shared_l3: Optional[ModelledStore] = None, write_policy: str = "write_back"
) -> Optional[TierManager]:
    """The tier manager for ``cfg``'s host and L3 budgets (None when both are 0). ``shared_l3``:
    an L3 store several instances share (the fleet replay), used instead of one of their own.
    ``write_policy``: the k3 config's ``tier_write_policy``, as the server passes it."""
    stores = []
    for name, budget in (("host", cfg.host_budget_bytes), ("l3", cfg.l3_budget_bytes)):
        if name == "l3" and shared_l3 is not None:
            stores.append(shared_l3)
        elif budget and budget > 0:
            stores.append(ModelledStore(int(budget), name, cfg.kv_bytes_per_symbol, checkpoint_bytes))
    if not stores:
        return None
    ns = Namespace(model="replay", tokenizer="replay", layout=SimTierIO.layout)
    return TierManager(stores, ns, SimTierIO(), write_policy=write_policy, block=1)


def load_seconds(cfg, store_name: str, nbytes: float) -> float:
    gbps = cfg.host_gbps if store_name == "host" else cfg.l3_gbps
    return nbytes / (gbps * 1e9)
