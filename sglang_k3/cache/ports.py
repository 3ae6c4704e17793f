"""The ports of the k3 cache: what the torch-free cache asks of the memory it does not own.

* :class:`CheckpointStore`: where checkpoints and the running requests' states live (the fp32
  mamba-slot store, the quantized checkpoint pool, the unified buffer's stores in ``state/``; the
  replay's simulated pool in ``benchmarks/policies/k3.py``).
* :class:`ExportSource`: the states one extend exported for one sequence.
* :class:`TierPort`: the lower tiers below the device (``sglang_k3.tiers.manager.TierManager``;
  the replay builds the same manager over modelled stores).

Every method takes and returns ints, sequences of ints and opaque plans: no tensors, so the cache
runs without torch and the replay drives the same code in simulated time.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence


class CheckpointStore(Protocol):
    """Where checkpoints live. Handles are ints the tree holds read-only; active slots are the
    requests' private, writable states. Every method takes and returns ints (no tensors)."""

    dtype: str  # "int8" | "bf16" | "fp32" | ...
    slot_bytes: int  # bytes one checkpoint holds (what the tree and its eviction account)
    shares_active_slots: bool  # checkpoints are slots of the active-state pool (fp32 store)
    batches_stores: bool  # stores may be queued and run in one call (alloc + store_many)

    def alloc(self) -> Optional[int]:
        """A fresh checkpoint handle (evicting through the cache if full), or None."""

    def capture_active(self, active_slot: int) -> Optional[int]:
        """Fork a running request's state: a new checkpoint holding a copy of it."""

    def donate(self, active_slot: int) -> Optional[int]:
        """A finished request's state becomes a checkpoint. A store that shares active slots
        returns ``active_slot`` itself (ownership moves, no copy); others copy into a new handle
        and leave the active slot to :meth:`release_active`."""

    def capture_export(self, source: "ExportSource", pos: int) -> Optional[int]:
        """A chunk-boundary state the extend exported (``source.kept(pos)`` is true)."""

    def store_many(self, active_slots: Sequence[int], handles: Sequence[int]) -> list[bool]:
        """Write each active slot into its allocated handle, in one call; False where refused
        (the store released that handle)."""

    def restore(self, handle: int, rid: str, active_slot: int) -> Optional[int]:
        """Copy-on-write of ``handle`` into the request's private ``active_slot``, deferred to the
        request's next forward. Returns the handle for the host's own copy mechanism to use
        (SGLang's ``mamba_cow_src_index``), or None when the store runs the copy itself."""

    def cancel_restore(self, rid: str) -> None:
        """Forget a deferred restore of ``rid`` that has not run (re-match, abort, release)."""

    def release_active(self, active_slot: int) -> None:
        """Give a request's active slot back to its pool."""

    def free(self, handles: Sequence[int]) -> None:
        """The tree let go of these checkpoints."""

    def stats(self) -> dict[str, int]:
        """The store's own counters (merged into the cache's stats)."""


class ExportSource(Protocol):
    """The states one extend exported for one sequence (host-specific; opaque to the tree)."""

    def grid(self) -> list[int]:
        """Absolute positions with an exported state, ascending."""

    def kept(self, pos: int) -> bool:
        """Whether the state after ``pos`` was kept (only planned rows are)."""


class TierPlan(Protocol):
    """Where a boundary a lower tier holds lies: after ``pos`` tokens, with its KV needed on the
    device from ``kv_from`` (what the device already holds below it stays)."""

    pos: int
    kv_from: int


class TierPort(Protocol):
    """The lower tiers, as the lifecycle's tier bridge (:mod:`sglang_k3.cache.tier_bridge`) drives
    them. ``write_policy`` is one of SGLang HiCache's names (``write_back``, ``write_through``,
    ``write_through_selective``)."""

    write_policy: str
    copies_up: bool  # a host tier sits above another tier (what the hold and the prefetch need)

    def save(self, tokens: Sequence[int], kv: Sequence[int], pos: int, handle: int, kind: int = 0) -> bool:
        """Copy the boundary after ``pos`` (its state ``handle``, the KV ``kv`` of ``tokens``) down."""

    def holds(self, tokens: Sequence[int], pos: int) -> bool:
        """Whether the boundary after ``pos`` is below already."""

    def find(self, tokens: Sequence[int], floor: int, cap: int, device_kv: int) -> Optional[TierPlan]:
        """The deepest boundary in ``(floor, cap]`` held below, or None."""

    def prefetch(self, tokens: Sequence[int], floor: int, cap: int, device_kv: int) -> bool:
        """Start copying that boundary up to the nearest tier while the request waits."""

    def copying_up(self, tokens: Sequence[int], floor: int, cap: int, device_kv: int) -> Optional[str]:
        """:meth:`prefetch`; the key of the boundary whose copy up runs now, or None."""

    def copy_running(self, key: str) -> bool:
        """Whether the copy up of boundary ``key`` is still running."""

    def wait_copy_up(self, timeout: float) -> bool:
        """Block (releasing the GIL) until some copy up ends, at most ``timeout`` seconds."""

    def load(self, plan: TierPlan, new_kv: Sequence[int], handle: int) -> Optional[int]:
        """Write the planned boundary's KV into ``new_kv`` and its state into ``handle``; the
        boundary's checkpoint kind, or None when a part is missing or invalid (nothing kept)."""

    def count_gain(self, plan: TierPlan, tokens: int) -> None:
        """A load restored ``tokens`` more than the device alone would have."""

    def note_no_memory(self) -> None:
        """A boundary was not brought up: the device had no room for it."""

    def stats(self) -> dict:
        """The tiers' counters (merged into the cache's stats)."""
