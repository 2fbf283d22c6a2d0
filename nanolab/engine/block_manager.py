"""Host block accounting: the pool's blocks with their reference counts, and each row's
`BlockTable`. The scheduler owns it.

The KV pool is cut into blocks of `block_size` tokens; a running
request holds one row, and its `BlockTable` (vLLM: a row of its block table) lists its blocks in
order, so token p lives in pool slot `blocks[p // block_size] * block_size + p % block_size`.
Every block a table gains is also staged for the device copy of the table (`take_new_entries`).
With prefix caching, full blocks are keyed by a hash chain over their tokens, and a table may
share the leading full blocks of another's (`BlockManager.cached_prefix`).
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterator


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def token_span(prompt: list[int], output: list[int], start: int, stop: int) -> list[int]:
    """Tokens start .. stop - 1 of a sequence of `prompt` then `output`, without listing the rest."""
    n = len(prompt)
    if stop <= n:
        return prompt[start:stop]
    if start >= n:
        return output[start - n: stop - n]
    return prompt[start:] + output[: stop - n]


class CacheFull(RuntimeError):
    """The pool has no free block or row left. The scheduler preempts before this can happen."""


def block_key(parent: bytes | None, tokens) -> bytes:
    """The key of a full block: a SHA-256 over its parent's key (None for a sequence's first block)
    and its own token ids, so two blocks share a key only when they and every block before them
    hold the same tokens (vLLM's prefix-caching hash chain)."""
    return next(chain_keys(parent, tokens, 0, 1, len(tokens)))


def packed_span(token_ids, first: int, stop: int, block_size: int) -> bytes:
    """Blocks first .. stop - 1 of `token_ids` as int64 bytes, native order: sliced from `token_ids`
    when it is already packed (`bytes`, as `Sequence.prompt_bytes`), else packed once here."""
    if isinstance(token_ids, bytes):
        return token_ids[8 * first * block_size: 8 * stop * block_size]
    return array.array("q", token_ids[first * block_size: stop * block_size]).tobytes()


def chain_keys(parent: bytes | None, token_ids, first: int, stop: int, block_size: int) -> Iterator[bytes]:
    """`block_key` of blocks first .. stop - 1 of `token_ids` (ints, or int64 bytes), in order, each
    chained to the one before (the first to `parent`): the tokens are packed to bytes once, not block
    by block."""
    data = packed_span(token_ids, first, stop, block_size)
    width = 8 * block_size
    for at in range(0, len(data), width):
        parent = hashlib.sha256((parent or b"") + data[at: at + width]).digest()
        yield parent


class KeyMemo:
    """`chain_keys` with the keys it computed last kept: (parent key, a block's token ids as bytes)
    -> key, at most `capacity` of them, the least recently used dropped first. A key depends on
    nothing else, so a kept one is always the right one, and the dict compares the whole pair, so
    two blocks never share an entry. A prompt behind a prefix that was keyed before hashes none of
    that prefix's blocks again: each costs a dict lookup of its bytes instead of a SHA-256."""

    def __init__(self, block_size: int, capacity: int) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be positive, got {block_size} and {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self._keys: OrderedDict[tuple[bytes | None, bytes], bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def chain(self, parent: bytes | None, token_ids, first: int, stop: int) -> Iterator[bytes]:
        """`chain_keys(parent, token_ids, first, stop, block_size)`, lazily, through the memo."""
        bs, keys = self.block_size, self._keys
        data = packed_span(token_ids, first, stop, bs)
        width = 8 * bs
        for at in range(0, len(data), width):
            entry = (parent, data[at: at + width])
            key = keys.get(entry)
            if key is None:
                key = keys[entry] = hashlib.sha256((parent or b"") + entry[1]).digest()
                if len(keys) > self.capacity:
                    keys.popitem(last=False)
            else:
                keys.move_to_end(entry)
            parent = key
            yield key


class BlockAllocator:
    """The pool's blocks: each free, or held by one or more block tables (its reference count).

    A held full block may carry a key (`block_key`), under which another table finds it (`lookup`)
    and shares it (`share`). A keyed block whose last holder releases it stays findable until a
    block is needed and no unkeyed one is free; then the least recently released is evicted (its
    key dropped) and handed out. Unkeyed released blocks are handed out first again (last in, first
    out): they hold nothing worth keeping."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unkeyed, held by none
        self._cached: OrderedDict[int, None] = OrderedDict()  # keyed, held by none: least recent first
        self._refs: dict[int, int] = {}  # held block -> holders
        self._block_of: dict[bytes, int] = {}  # key -> block
        self._key_of: dict[int, bytes] = {}  # block -> key
        self.evictions = 0
        # Counts every change to which keys are cached where (a key added, a key evicted): a lookup
        # made at one epoch finds the same blocks at the same epoch.
        self.key_epoch = 0

    @property
    def num_free(self) -> int:
        """Blocks held by none, keyed ones (evictable) included."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Keyed blocks, held or not."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        """Keyed blocks held by none: free to take, and findable until taken."""
        return len(self._cached)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def held(self) -> set[int]:
        return set(self._refs)

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.evictions += 1
            self.key_epoch += 1
        else:
            raise CacheFull(f"all {self.num_blocks} blocks of the KV pool are in use")
        self._refs[block] = 1
        return block

    def release(self, blocks) -> None:
        """Drop one reference to each of `blocks`, a table's blocks in order. The last is released
        first, so a cached prefix outlives its tail: the tail is evicted before it."""
        for block in reversed(list(blocks)):
            n = self._refs.get(block, 0)
            assert n > 0, f"block {block} released but not held"
            if n > 1:
                self._refs[block] = n - 1
                continue
            del self._refs[block]
            if block in self._key_of:
                self._cached[block] = None  # the most recent: evicted last
            else:
                self._free.appendleft(block)

    def lookup(self, key: bytes) -> int | None:
        """The block cached under `key`, held or not, or None."""
        return self._block_of.get(key)

    def share(self, block: int) -> None:
        """One more reference to a keyed block: one held already, or one waiting to be evicted."""
        if block in self._refs:
            self._refs[block] += 1
            return
        assert block in self._cached, f"block {block} is neither held nor cached"
        del self._cached[block]
        self._refs[block] = 1

    def set_key(self, block: int, key: bytes) -> bool:
        """Cache a held block under `key`, once full. False (and nothing changes) when another block
        already holds that key or this one has a key: the first block computed under a key keeps it."""
        assert block in self._refs, f"block {block} keyed but not held"
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        self.key_epoch += 1
        return True


class BlockTable:
    """One sequence's blocks, in order, how many tokens it holds, and with prefix caching the keys
    of its leading full blocks (`keys[i]` is `blocks[i]`'s chain key)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[int] = []
        self.num_tokens = 0
        self.keys: list[bytes] = []

    def slot(self, p: int) -> int:
        """Flat pool slot of token p."""
        if not 0 <= p < self.num_tokens:
            raise IndexError(f"token {p} is outside a table of {self.num_tokens} tokens")
        return self.blocks[p // self.block_size] * self.block_size + p % self.block_size

    def blocks_needed(self, new_tokens: int) -> int:
        """Blocks this table must gain to hold `new_tokens` more."""
        return max(0, cdiv(self.num_tokens + new_tokens, self.block_size) - len(self.blocks))


class BlockManager:
    """The allocator and one `BlockTable` per row (`max_rows` rows, the engine's batch slots).

    With `enable_prefix_caching`, a row's full blocks are keyed once their tokens are written
    (`commit_full_blocks`), and a new row can start from the cached blocks of its longest keyed
    prefix (`cached_prefix`, `share_prefix`), sharing them by reference: only full blocks are
    ever shared, so a block a table writes into is its own."""

    def __init__(self, num_blocks: int, block_size: int, max_rows: int, enable_prefix_caching: bool = False) -> None:
        if block_size < 1 or max_rows < 1:
            raise ValueError(f"block_size and max_rows must be positive, got {block_size} and {max_rows}")
        self.enable_prefix_caching = enable_prefix_caching
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: list[BlockTable | None] = [None] * max_rows
        self._new: dict[tuple[int, int], int] = {}  # (row, column) -> block, not yet on the device
        # A key for every block the pool holds: more would only be found if their blocks had stayed cached.
        self.key_memo = KeyMemo(block_size, num_blocks)

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

    def cached_prefix(self, token_ids) -> tuple[list[int], list[bytes]]:
        """The cached blocks (and their keys) of the longest run of full blocks that begins
        `token_ids` (ints, or int64 bytes as `Sequence.prompt_bytes`), leaving at least its last token
        uncached: a request must compute one token to be sampled. Empty without prefix caching."""
        blocks, keys = [], []
        if not self.enable_prefix_caching:
            return blocks, keys
        num_tokens = len(token_ids) // 8 if isinstance(token_ids, bytes) else len(token_ids)
        for key in self.key_memo.chain(None, token_ids, 0, (num_tokens - 1) // self.block_size):
            block = self.allocator.lookup(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
        return blocks, keys

    def share_prefix(self, row: int, blocks: list[int], keys: list[bytes]) -> None:
        """Start the empty `row` with `cached_prefix`'s blocks, each shared by one more reference:
        the row then holds their tokens, and staged table entries point the device at them."""
        table = self.table(row)
        if table.blocks or table.num_tokens:
            raise ValueError(f"row {row} already holds {table.num_tokens} tokens: a prefix starts an empty row")
        for block in blocks:
            self.allocator.share(block)
            self._new[row, len(table.blocks)] = block
            table.blocks.append(block)
        table.keys = list(keys)
        table.num_tokens = len(blocks) * self.block_size

    def truncate(self, row: int, num_tokens: int) -> None:
        """Shorten `row` to its first `num_tokens` tokens (a speculative step's rejected drafts),
        releasing the blocks past them. Never into a keyed block: keys cover accepted tokens only."""
        table = self.table(row)
        if not len(table.keys) * self.block_size <= num_tokens <= table.num_tokens:
            raise ValueError(f"row {row}: cannot truncate {table.num_tokens} tokens to {num_tokens} "
                             f"({len(table.keys)} blocks keyed)")
        keep = cdiv(num_tokens, self.block_size)
        self.allocator.release(table.blocks[keep:])
        del table.blocks[keep:]
        table.num_tokens = num_tokens

    def commit_rows(self, seqs) -> None:
        """`commit_full_blocks` for each of `seqs` (`Sequence`s: `.row`, None once it left, and
        the prompt's and output's ids) whose row has a full block not keyed yet. Called every step
        over every row: the check is inlined, and only the tokens of the blocks due are sliced out."""
        if not self.enable_prefix_caching:
            return
        tables, bs = self.tables, self.block_size
        for seq in seqs:
            row = seq.row
            if row is not None and tables[row].num_tokens >= (len(tables[row].keys) + 1) * bs:
                self._key_full_blocks(tables[row], seq.prompt_token_ids, seq.output_token_ids)

    def commit_full_blocks(self, row: int, token_ids) -> None:
        """Key every full block of `row` not keyed yet whose tokens `token_ids` (the sequence's, as
        far as the host knows them) covers, once its K/V is written or queued to be. Nothing
        without prefix caching."""
        if self.enable_prefix_caching:
            self._key_full_blocks(self.table(row), token_ids, ())

    def _key_full_blocks(self, table: BlockTable, prompt, output) -> None:
        """`commit_full_blocks` on `table`, its sequence's ids `prompt` then `output`: only the tokens
        of the blocks due are sliced out (`token_span`)."""
        bs, first = self.block_size, len(table.keys)
        stop = min(table.num_tokens, len(prompt) + len(output)) // bs * bs
        if stop <= first * bs:
            return
        parent = table.keys[-1] if table.keys else None
        keys = self.key_memo.chain(parent, token_span(prompt, output, first * bs, stop), 0, stop // bs - first)
        for i, key in enumerate(keys, first):
            self.allocator.set_key(table.blocks[i], key)
            table.keys.append(key)

    def table(self, row: int) -> BlockTable:
        table = self.tables[row] if 0 <= row < self.max_rows else None
        if table is None:
            raise ValueError(f"row {row} is not open")
        return table

    def grow(self, rows, new_tokens) -> None:
        """Give row i new_tokens[i] more tokens, allocating blocks as they fill; `rows` are distinct
        (each row's need is counted from its table before the call). All or nothing: a row that is
        not open, or a pool that cannot hold them all, raises before any table changes."""
        # Called every step over every row: `table` and `blocks_needed` inlined, each row's need
        # counted once.
        tables, bs = self.tables, self.block_size
        grown, needed = [], 0
        for row, n in zip(rows, new_tokens, strict=True):
            table = tables[row] if 0 <= row < len(tables) else None
            if table is None:
                raise ValueError(f"row {row} is not open")
            gain = max(0, -(-(table.num_tokens + n) // bs) - len(table.blocks))
            grown.append((row, table, n, gain))
            needed += gain
        if needed > self.allocator.num_free:
            raise CacheFull(f"this step needs {needed} blocks, the pool has {self.allocator.num_free} free")
        for row, table, n, gain in grown:
            for _ in range(gain):
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
