"""The block manager's per-block records and free list, built lazily, so a pool of millions of blocks costs nothing
until its blocks are used.

A GPU with tens of GB of KV memory holds millions of blocks of a small model; a Python object per block made up
front took about a second and ~150 MB per million. Here a ``Block`` record exists only once its block has been
handed out, and the free list is a counter over never-used ids plus a queue of returned ones, in exactly the order
a full list would give. Introduced with the block manager in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyBlocks(Generic[T]):
    """``blocks[i]`` for i in [0, num_blocks): made by ``make(i)`` the first time it is read. Notebook 06."""

    def __init__(self, num_blocks: int, make: Callable[[int], T]) -> None:
        self._num_blocks = num_blocks
        self._make = make
        self._made: dict[int, T] = {}

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, block_id: int) -> T:
        item = self._made.get(block_id)
        if item is None:
            if not 0 <= block_id < self._num_blocks:
                raise IndexError(f"block {block_id} is outside the pool [0, {self._num_blocks})")
            item = self._made[block_id] = self._make(block_id)
        return item

    def __iter__(self) -> Iterator[T]:  # every block: makes them all (small pools; debug checks use ``made``)
        return (self[i] for i in range(self._num_blocks))

    def made(self) -> list[T]:
        """The records made so far; every other block was never handed out."""
        return list(self._made.values())

    @property
    def num_made(self) -> int:
        """Records made so far (at most the blocks ever handed out, plus any read)."""
        return len(self._made)


class FreeBlockQueue:
    """Free block ids in hand-out order: never-used ids first (ascending), then returned ones (first returned, first
    reused), the order of a deque that started as ``range(num_blocks)``. Notebook 06."""

    def __init__(self, num_blocks: int) -> None:
        self._next_fresh = 0
        self._num_blocks = num_blocks
        self._returned: deque[int] = deque()

    def __len__(self) -> int:
        return self._num_blocks - self._next_fresh + len(self._returned)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[int]:
        yield from range(self._next_fresh, self._num_blocks)
        yield from self._returned

    def __getitem__(self, i: int) -> int:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("free list index out of range")
        fresh = self._num_blocks - self._next_fresh
        return self._next_fresh + i if i < fresh else self._returned[i - fresh]

    @property
    def first_fresh(self) -> int:
        """Every id from here up was never handed out (and is free)."""
        return self._next_fresh

    def returned(self) -> list[int]:
        """The ids given back, in the order they will be reused."""
        return list(self._returned)

    def popleft(self) -> int:
        if self._next_fresh < self._num_blocks:
            self._next_fresh += 1
            return self._next_fresh - 1
        return self._returned.popleft()

    def append(self, block_id: int) -> None:
        self._returned.append(block_id)
