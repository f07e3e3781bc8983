"""The physical side of the paged KV cache: blocks, their LRU free list and the prefix-cache map.

Pure Python (no torch): the pool only hands out block ids; the runner owns the tensors.

Every block is in exactly one of three states, and ``free + cached + in_use == total`` always:

* ``free``   -- ref count 0, no hash: holds nothing worth keeping;
* ``cached`` -- ref count 0, hashed: holds the KV of one full block of tokens that a later request
  with the same prefix may reuse; it stays in the free list and is evicted (hash dropped) only when
  the allocator takes it;
* ``in_use`` -- ref count > 0: owned by one or more running requests (hashed or not).

The free list is a doubly linked list threaded through the blocks themselves, so taking a cached
block back out of the middle of it on a prefix hit is O(1). Allocation pops from the head;
released hashed blocks go to the tail (least recently used first out), released unhashed blocks
go to the head (they hold nothing, so they should be reused before any cached block). Blocks
never handed out are made only when the head of the list reaches them (``FreeBlockQueue``).

Prefix-cache safety: a block is reused only if its stored token ids equal the request's tokens
for that block AND its stored parent link ``(parent block id, parent generation)`` names the
block matched one level up. ``generation`` changes every time a block is handed out afresh, so a
link to a parent that was since evicted and rewritten can never match. By induction over the
blocks of a prefix, a hit means the whole token prefix is equal, whatever the hash function does.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_NO_PARENT = -1


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()   # the block's tokens, stored while hashed (hit verification)
    parent_id: int = _NO_PARENT        # block holding the previous block of tokens when hashed
    parent_gen: int = -1               # that parent's generation at registration time
    generation: int = 0                # bumped each time the block is allocated afresh
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of ref-0 blocks with sentinels: O(1) push at both ends, pop at the head
    and removal from the middle.

    A block that was never handed out is not an object until it is needed: the blocks not created
    yet are a range of ids standing at a marker node between the blocks pushed at the head and
    those pushed at the tail, exactly where they would stand as nodes, and they are created in id
    order as the head reaches them (``make``). A pool of 100k blocks (a small model's default
    pool) costs nothing to build instead of half a second; ``created`` lists the blocks made."""

    def __init__(self, num_blocks: int) -> None:
        self.created: list[KVBlock] = []   # ids 0 .. len - 1; the rest are free and unmade
        self._total = num_blocks
        self._head, self._fresh, self._tail = KVBlock(block_id=-1), KVBlock(block_id=-1), KVBlock(block_id=-1)
        self._head.next_free, self._fresh.prev_free = self._fresh, self._head
        self._fresh.next_free, self._tail.prev_free = self._tail, self._fresh
        self._len = 0                      # blocks linked as nodes

    def __len__(self) -> int:
        return self._len + self.num_unmade

    @property
    def num_unmade(self) -> int:
        return self._total - len(self.created)

    def make(self, block_id: int) -> None:
        """Creates the blocks up to ``block_id``, each linked where the marker stands."""
        if block_id >= self._total:
            raise IndexError(f"block {block_id} of {self._total}")
        while len(self.created) <= block_id:
            block = KVBlock(block_id=len(self.created))
            self.created.append(block)
            self._link_after(self._fresh.prev_free, block)  # type: ignore[arg-type]

    def _link_after(self, anchor: KVBlock, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free list")
        nxt = anchor.next_free
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block  # type: ignore[union-attr]
        self._len += 1

    def append(self, block: KVBlock) -> None:
        self._link_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        self._link_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None or block.block_id < 0:
            raise RuntimeError(f"block {block.block_id} is not in the free list")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._fresh:
            if self.num_unmade:
                self.make(len(self.created))
                first = self._head.next_free
            else:
                first = self._fresh.next_free
        if first is self._tail or first is None:
            raise RuntimeError("no free block left")
        self.remove(first)  # type: ignore[arg-type]
        return first  # type: ignore[return-value]

    def __iter__(self):
        """Every free block in order (creating the unmade ones)."""
        self.make(self._total - 1)
        return self._nodes()

    def _nodes(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            if node is not self._fresh:
                yield node
            node = node.next_free

    def check(self) -> list[str]:
        """Link consistency; returns problems found (empty when sound)."""
        problems, seen, prev = [], set(), self._head
        node = self._head.next_free
        while node is not None and node is not self._tail:
            if node is not self._fresh:
                if node.block_id in seen:
                    problems.append(f"block {node.block_id} twice in the free list")
                    break
                seen.add(node.block_id)
            if node.prev_free is not prev:
                problems.append(f"block {node.block_id}: broken back link")
            prev, node = node, node.next_free
        if self._tail.prev_free is not prev:
            problems.append("free list tail does not match the last block")
        if len(seen) != self._len:
            problems.append(f"free list holds {len(seen)} blocks but counts {self._len}")
        return problems

    def linked_ids(self) -> set[int]:
        """Ids of the free blocks created so far (without creating any)."""
        return {b.block_id for b in self._nodes()}


class _Blocks(Sequence):
    """``BlockPool.blocks``: block ``i`` by id, created on first access (see FreeBlockQueue)."""

    def __init__(self, queue: FreeBlockQueue, total: int) -> None:
        self._queue, self._total = queue, total

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, index):
        if isinstance(index, slice):
            ids = range(*index.indices(self._total))
            if ids:
                self._queue.make(max(ids))
            return [self._queue.created[i] for i in ids]
        i = index + self._total if index < 0 else index
        if not 0 <= i < self._total:
            raise IndexError(f"block {index} of {self._total}")
        self._queue.make(i)
        return self._queue.created[i]

    def __iter__(self):
        self._queue.make(self._total - 1)
        return iter(self._queue.created)


@dataclass(frozen=True)
class BlockPoolStats:
    free: int       # ref 0, no hash
    cached: int     # ref 0, hashed (reusable prefix, evictable)
    in_use: int     # ref > 0
    total: int


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: must be a positive integer, got {num_blocks!r}")
        self.free_queue = FreeBlockQueue(num_blocks)
        self.blocks = _Blocks(self.free_queue, num_blocks)   # by id; made on first use
        self.cached: dict[int, KVBlock] = {}  # block hash -> block holding those tokens

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def created(self) -> list[KVBlock]:
        """The blocks made so far; every other block is free, unhashed and was never used."""
        return self.free_queue.created

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free plus evictable cached ones."""
        return len(self.free_queue)

    def take_new(self, n: int) -> list[KVBlock]:
        """Pops ``n`` blocks from the head of the free list, evicting their hashes."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._drop_hash(block)
            block.generation += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes one more reference on each block (a prefix hit), unlinking ref-0 ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference on each block, in the given order (first given, first evicted)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released with ref count {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def lookup(self, block_hash: int, token_ids: Sequence[int], parent: KVBlock | None) -> KVBlock | None:
        """The cached block for this hash if it provably holds these tokens after this parent."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        if parent is None:
            return block if block.parent_id == _NO_PARENT else None
        if block.parent_id != parent.block_id or block.parent_gen != parent.generation:
            return None
        return block

    def register(self, block: KVBlock, block_hash: int, token_ids: Sequence[int],
                 parent: KVBlock | None) -> bool:
        """Makes a full block findable by hash. False when the hash is already taken (the same
        tokens computed twice, or a collision): the block simply stays unhashed."""
        if block.block_hash is not None:
            raise RuntimeError(f"block {block.block_id} is already hashed")
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        if parent is None:
            block.parent_id, block.parent_gen = _NO_PARENT, -1
        else:
            block.parent_id, block.parent_gen = parent.block_id, parent.generation
        self.cached[block_hash] = block
        return True

    def _drop_hash(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        block.parent_id, block.parent_gen = _NO_PARENT, -1

    def reset_prefix_cache(self) -> int:
        """Forgets every hash (e.g. after new weights are loaded); returns how many were dropped.
        Blocks in use keep their KV and owners; they just cannot be found by hash any more."""
        dropped = list(self.cached.values())
        for block in dropped:
            self._drop_hash(block)
        return len(dropped)

    def stats(self) -> BlockPoolStats:
        cached_free = sum(1 for b in self.cached.values() if b.ref_cnt == 0)
        num_free = len(self.free_queue)
        return BlockPoolStats(free=num_free - cached_free, cached=cached_free,
                              in_use=self.num_blocks - num_free, total=self.num_blocks)

    def check_invariants(self) -> None:
        problems = self.free_queue.check()
        listed = self.free_queue.linked_ids()
        for block in self.created:
            if block.ref_cnt < 0:
                problems.append(f"block {block.block_id}: ref count {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in listed):
                problems.append(f"block {block.block_id}: ref {block.ref_cnt} but "
                                f"{'in' if block.block_id in listed else 'not in'} the free list")
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                problems.append(f"block {block.block_id}: hashed but not in the cache map")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                problems.append(f"cache map entry {block_hash} points at block {block.block_id} "
                                f"hashed {block.block_hash}")
        s = self.stats()
        if s.free + s.cached + s.in_use != s.total or min(s.free, s.cached, s.in_use) < 0:
            problems.append(f"counts do not add up: {s}")
        if problems:
            raise AssertionError("KV block pool invariants broken: " + "; ".join(problems))


def num_blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                          dtype_bytes: int, block_size: int) -> int:
    """How many blocks (K and V, every layer) fit in ``budget_bytes``."""
    for name, value in (("kv_cache_memory_bytes", budget_bytes), ("num_layers", num_layers),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes: {budget_bytes} bytes hold no KV block; one block of "
            f"{block_size} tokens needs {bytes_per_block} bytes ({num_layers} layers x K and V x "
            f"{num_kv_heads} kv heads x head_dim {head_dim} x {dtype_bytes} bytes)")
    return num_blocks
