"""Host block accounting: the pool's free list and each row's `BlockTable`. The scheduler owns it.

The KV pool is cut into blocks of `block_size` tokens; a running
request holds one row, and its `BlockTable` (vLLM: a row of its block table) lists its blocks in
order, so token p lives in pool slot `blocks[p // block_size] * block_size + p % block_size`.
Every block a table gains is also staged for the device copy of the table (`take_new_entries`).
"""

from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CacheFull(RuntimeError):
    """The pool has no free block or row left. The scheduler preempts before this can happen."""


class BlockAllocator:
    """The free list of the pool's blocks. Every block is either free or owned, never both.
    Released blocks are handed out first again (last in, first out)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFull(f"all {self.num_blocks} blocks of the KV pool are in use")
        block = self._free.popleft()
        self._used.add(block)
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            assert block in self._used, f"block {block} released but not owned"
            self._used.remove(block)
            self._free.appendleft(block)


class BlockTable:
    """One sequence's blocks, in order, and how many tokens it holds."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[int] = []
        self.num_tokens = 0

    def slot(self, p: int) -> int:
        """Flat pool slot of token p."""
        if not 0 <= p < self.num_tokens:
            raise IndexError(f"token {p} is outside a table of {self.num_tokens} tokens")
        return self.blocks[p // self.block_size] * self.block_size + p % self.block_size

    def blocks_needed(self, new_tokens: int) -> int:
        """Blocks this table must gain to hold `new_tokens` more."""
        return max(0, cdiv(self.num_tokens + new_tokens, self.block_size) - len(self.blocks))


class BlockManager:
    """The allocator and one `BlockTable` per row (`max_rows` rows, the engine's batch slots)."""

    def __init__(self, num_blocks: int, block_size: int, max_rows: int) -> None:
        if block_size < 1 or max_rows < 1:
            raise ValueError(f"block_size and max_rows must be positive, got {block_size} and {max_rows}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: list[BlockTable | None] = [None] * max_rows
        self._new: dict[tuple[int, int], int] = {}  # (row, column) -> block, not yet on the device

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def max_rows(self) -> int:
        return len(self.tables)

    def free_row_count(self) -> int:
        return sum(table is None for table in self.tables)

    def open_row(self) -> int:
        for row, table in enumerate(self.tables):
            if table is None:
                self.tables[row] = BlockTable(self.block_size)
                return row
        raise CacheFull(f"all {self.max_rows} rows are in use")

    def free_row(self, row: int) -> None:
        """Return a row and every block it owns to the pool."""
        self.allocator.release(self.table(row).blocks)
        self.tables[row] = None

    def table(self, row: int) -> BlockTable:
        table = self.tables[row] if 0 <= row < self.max_rows else None
        if table is None:
            raise ValueError(f"row {row} is not open")
        return table

    def blocks_needed(self, rows, new_tokens) -> int:
        """Blocks `rows` must gain to take new_tokens[i] more tokens each."""
        return sum(self.table(row).blocks_needed(n) for row, n in zip(rows, new_tokens, strict=True))

    def grow(self, rows, new_tokens) -> None:
        """Give row i new_tokens[i] more tokens, allocating blocks as they fill. All or nothing: a
        pool that cannot hold them all raises CacheFull before any table changes."""
        rows, new_tokens = list(rows), list(new_tokens)
        needed = self.blocks_needed(rows, new_tokens)
        if needed > self.allocator.num_free:
            raise CacheFull(f"this step needs {needed} blocks, the pool has {self.allocator.num_free} free")
        for row, n in zip(rows, new_tokens, strict=True):
            table = self.table(row)
            for _ in range(table.blocks_needed(n)):
                block = self._take_block(row, len(table.blocks))
                self._new[row, len(table.blocks)] = block
                table.blocks.append(block)
            table.num_tokens += n

    def _take_block(self, row: int, column: int) -> int:
        """The block for a row's new table cell: the allocator's next free one."""
        return self.allocator.allocate()

    def take_new_entries(self) -> dict[tuple[int, int], int]:
        """The (row, column) -> block entries gained since the last call. A dict, so a row freed and
        reopened in between keeps only its newest entry."""
        new, self._new = self._new, {}
        return new
