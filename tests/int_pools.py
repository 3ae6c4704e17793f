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


class PagedPool:
    """KV slots handed out in whole pages, freed as SGLang's paged allocator frees them: any index
    given back frees the whole page that holds it. A row of ``n`` tokens puts position ``q`` at
    offset ``q % page_size`` of its page, as SGLang's paged rows do."""

    def __init__(self, pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = list(range(pages - 1, -1, -1))
        self.allocated: set[int] = set()  # pages

    def alloc_row(self, n: int) -> list[int]:
        p = self.page_size
        out: list[int] = []
        for _ in range(-(-n // p)):
            if not self.free_pages:
                raise MemoryError("paged pool exhausted")
            page = self.free_pages.pop()
            self.allocated.add(page)
            out.extend(page * p + i for i in range(p))
        return out[:n]

    def free(self, idx: list[int]) -> set[int]:
        pages = {i // self.page_size for i in idx}
        for page in pages:
            if page not in self.allocated:
                raise AssertionError(f"double free of page {page}")
            self.allocated.remove(page)
            self.free_pages.append(page)
        return pages
