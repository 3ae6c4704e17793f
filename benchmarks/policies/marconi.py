"""``marconi``: Marconi (Pan et al., "Marconi: Prefix Caching for the Era of Hybrid LLMs", MLSys
2025), as its released code behaves, replayed on our tree. Sources are files of
github.com/ruipeterpan/marconi at 0801661: ``radix_cache_hybrid.py`` (RC), ``config_tuner.py``
(CT), ``utils.py`` (U); the Marconi policy is ``evict_policy_version=2`` (artifact_evaluation.md).

Rules, each with its source:

1. **Admission: states only at branch points and at the last token.** A sequence's insert stores
   the state after its last decoded token at the new leaf (RC:120-125, 305-319), and a state at
   the point where it branches off an existing edge, found by speculative insertion (RC:158-160,
   247, 322-343). There is no prompt-end (input-only) state. Here: ``find_branch_point`` before the
   prefill, the generation end at finish; no chunk-end or decode states, no per-path cap, nothing
   recycled.
2. **Eviction candidates: every node with at most one child** (RC:383-394), re-ranked after each
   eviction (RC:506-508). A leaf goes with its KV (RC:554-556); a one-child node loses only its
   state, its KV merging into the child (RC:417-434, 558-559). KV never goes without its state.
   Here: a checkpoint is a Marconi node's state. The last checkpoint of an unlocked leaf goes with
   the leaf's KV back to the checkpoint before it; any other checkpoint not at a fork (at most one
   live continuation) goes alone; KV with no state after it (which Marconi never holds) goes first.
3. **Utility = alpha x norm(FLOP efficiency) + norm(recency)**, lowest evicted first (RC:535,
   543-551); min-max normalisation over the candidates, all 1 when they are equal (U:11-19);
   recency ``1 / (now - last_access)`` on a logical clock (RC:135, 235, 467). FLOP efficiency is the
   FLOPs of the node's own segment (from the state before it to it) over the state's bytes plus
   the KV of the *whole* root-to-node prefix (RC:517-531).
4. **alpha by bootstrap.** alpha = 0 (LRU) until the first eviction (RC:83). At the first eviction
   the number of requests seen so far, ``n``, sets a window of ``5 n`` requests (RC:469-472,
   multiplier 5: RC:84). When the window is full, a copy of the empty cache replays the window once
   per alpha in ``0, 0.1, ..., 2.0`` (CT:61), each request a lookup then an insert of prompt +
   output (CT:13-45), and the alpha that saved the most prefill FLOPs over the window's last 500
   requests is kept (CT:96, 110) for the rest of the run; no re-tuning (RC:113, 147-154). If
   nothing is ever evicted, alpha stays 0.
5. **One pool for KV and states** (RC:97, 164-193); states in ``--checkpoint-dtype`` (Marconi stores
   the model's state; giving it k3's dtype compares placement and retention only).

Deviations: positions snap down to the 64-token hit unit (Marconi keeps exact last-token states;
the loss is < 64 tokens per hit and the same for k3); Marconi finds branch points when it inserts
prompt + output, here when the prompt is matched; Marconi's code has two slips (the freed bytes of
a leaf eviction read a stale variable, RC:555; its MLP FLOPs subtract attention FLOPs, RC:526),
which are not reproduced; eviction runs down to the replay's common low watermark.
"""

from __future__ import annotations

import dataclasses

from benchmarks.policies.base import ScaledCost, SimConfig
from benchmarks.policies.placement_tree import PlacementTreePolicy, scaled_placement
from sglang_k3.cache import EvictionPolicy, PlacementPolicy

ALPHAS = tuple(round(0.1 * k, 1) for k in range(21))  # CT:61
BOOTSTRAP_MULTIPLIER = 5  # RC:84
TUNING_TAIL = 500  # CT:96: FLOPs saved over the window's last 500 requests


def _norm(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [1.0] * len(values)  # U:11-19
    return [(v - lo) / (hi - lo) for v in values]


class MarconiPolicy(PlacementTreePolicy):
    name = "marconi"

    def __init__(self, cfg: SimConfig, budget_bytes, alpha: float = 0.0, tune: bool = True):
        self.placement = scaled_placement(
            PlacementPolicy(),
            cfg.unit,
            at_chunk_end=False,
            at_prompt_end=False,
            at_generation_end=True,
            at_branch_points=True,
            decode_interval=None,
            per_path_budget=None,
            recycle_superseded=False,
            drop_superseded=False,
        )
        ev = dataclasses.replace(
            EvictionPolicy(), cost=ScaledCost(cfg.cost, cfg.unit), alpha=alpha, kv_dtype=cfg.kv_dtype
        )
        super().__init__(
            cfg=cfg,
            budget_bytes=budget_bytes,
            page=1,
            hit_unit=self.placement.hit_unit,
            eviction=ev,
            state_dtype=cfg.checkpoint_dtype,
        )
        self.alpha = alpha
        self.tune = tune
        self.history: list[int] = []
        self.window = 0  # 0: no eviction yet
        self.tuned_alpha = None
        self.tuning_scores: dict = {}

    # ------------------------------------------------------------------ rule 4: bootstrap
    def admit(self, trace, i):
        self.history.append(i)
        if self.tune and self.window and len(self.history) == self.window and self.tuned_alpha is None:
            self._tune(trace)
        return super().admit(trace, i)

    def _tune(self, trace) -> None:
        cost = self.cfg.cost
        tail = self.history[-TUNING_TAIL:]
        tail_start = len(self.history) - len(tail)
        for a in ALPHAS:
            p = MarconiPolicy(self.cfg, self.budget_bytes, alpha=a, tune=False)
            saved = 0.0
            for k, j in enumerate(self.history):
                adm = super(MarconiPolicy, p).admit(trace, j)
                p.finish(trace, j, adm.ctx)
                if k >= tail_start:
                    L = trace.input_len[j]
                    saved += cost.prefill_flops(0, L) - cost.prefill_flops(adm.hit_tokens, L)
            self.tuning_scores[a] = saved
        best = max(ALPHAS, key=lambda a: (self.tuning_scores[a], -ALPHAS.index(a)))
        self.tuned_alpha = self.alpha = self.tree.policy.alpha = best

    # ------------------------------------------------------------------ rules 2-3: eviction
    def enforce_budget(self) -> None:
        if self.budget_bytes is None:
            return
        tree = self.tree
        if self.kv_bytes() + tree.checkpoint_bytes() > self.budget_bytes:
            if not self.window:
                self.window = BOOTSTRAP_MULTIPLIER * len(self.history)  # RC:469-472
            low = self.budget_bytes * (1.0 - self.cfg.evict_watermark)
            tree.trim_dead_tails(lambda: self.kv_bytes() + tree.checkpoint_bytes() <= low)  # KV with no state after it
            while self.kv_bytes() + tree.checkpoint_bytes() > low:
                if not self._evict_one():
                    break
        excess = max(0.0, self.kv_bytes() + tree.checkpoint_bytes() - self.budget_bytes)
        self.overshoot_max = max(self.overshoot_max, excess)

    def _candidates(self) -> list:
        tree = self.tree
        out = []
        for ck in tree.checkpoints():
            n = ck.node
            if not tree.checkpoint_evictable(ck):
                continue
            if ck.pos == n.end and not n.is_leaf and tree.is_branch_point(ck):
                continue  # a node with two or more children: not a candidate
            out.append(ck)
        return out

    def _evict_one(self) -> bool:
        tree = self.tree
        cands = self._candidates()
        if not cands:
            return False
        now = max(c.last_access for c in cands) + 1
        rec = _norm([1.0 / (now - c.last_access) for c in cands])
        kvb = self.cfg.kv_bytes_per_symbol
        eff = _norm([tree.saved_flops(c) / (c.nbytes + c.pos * kvb) for c in cands])
        k = min(range(len(cands)), key=lambda i: (self.alpha * eff[i] + rec[i], i))
        ck = cands[k]
        node = ck.node
        tree.evict_checkpoint(ck)
        while node is not None and node.parent is not None and node.is_leaf and not node.lock_ref:
            parent = node.parent
            if not tree.trim_dead_tail(node).kv_indices or node.parent is not None:
                break  # trimmed back to a checkpoint, or nothing to trim
            node = parent  # the leaf went: its parent may now end in KV with no state
        return True

    def summary(self):
        d = super().summary()
        d["alpha"] = self.alpha
        d["alpha_bootstrap_window"] = self.window
        d["alpha_tuned"] = self.tuned_alpha is not None
        d["alpha_tuning_flops_saved"] = {str(a): v for a, v in self.tuning_scores.items()}
        return d
