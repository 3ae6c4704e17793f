"""Integer stand-ins for the KV and checkpoint pools, for the tree tests.

They catch the bugs the tree must never cause: double free, use of a freed slot, and a write to a
slot the tree holds as a shared checkpoint (each write bumps a version; a reader that saw version
v at pin time checks it again when its copy lands)."""

from __future__ import annotations


class IntPool:
    def __init__(self, size: int, page_size: int = 1) -> None:
        self.size, self.page_size = size, page_size
        self.free_list = list(range(size - 1, -1, -1))
        self.allocated: set[int] = set()
        self.version = [0] * size

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free_list):
            raise MemoryError(f"pool exhausted: want {n}, have {len(self.free_list)}")
        out = [self.free_list.pop() for _ in range(n)]
        self.allocated.update(out)
        return out

    def free(self, idx: list[int]) -> None:
        for i in idx:
            if i not in self.allocated:
                raise AssertionError(f"double free or foreign index {i}")
            self.allocated.remove(i)
            self.free_list.append(i)

    def write(self, i: int) -> None:
        if i not in self.allocated:
            raise AssertionError(f"write to free slot {i}")
        self.version[i] += 1

    @property
    def used(self) -> int:
        return len(self.allocated)
