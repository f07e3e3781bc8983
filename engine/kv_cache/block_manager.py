"""The logical side of the paged KV cache: which blocks each request owns, prefix-cache lookups,
and slot allocation for a step. Pure Python (no torch).

The scheduler sees only block ids. For one request, block ``i`` of its table holds the KV of token
positions ``i * block_size .. (i + 1) * block_size - 1``.

Prefix caching: the hash of full block ``i`` of a request is
``hash_block_tokens(hash of block i-1, its token ids, extra keys)``, so equal hashes mean (barring
collisions) equal prefixes. Blocks are registered in the pool's cache map when they become full of
known tokens, at the allocation of the step that computes them (the forward of that step writes
their KV before any later step can read them). A hit is verified against stored tokens and parent
links in the pool (see ``block_pool``), so a collision can only cost a miss, never wrong KV.

Sliding windows (``sliding_window``, set only when every layer of every model sharing the pool
slides): a query at position p reads positions p - window + 1 .. p, so once a request's first
uncomputed position is c, its blocks wholly before position c - window + 1 are never read
again. ``allocate_slots`` releases them (``_release_out_of_window``) and a request then holds at
most ceil((window - 1 + new tokens) / block_size) + 1 blocks. Its table keeps its length: a
released entry still names the block it had (``get_block_ids``), which may since hold another
request's tokens; the attention kernels never read before a row's window. The request's
``_req_num_released`` leading entries are no longer its own (not released again by ``free``,
not counted by ``check_invariants``).

A released block keeps its hash, so it stays a cached block: a later request with the same
prefix may hit it, which is correct (a block's K/V depend only on the tokens up to it, whatever
the window) and verified as any hit (tokens and parent links). A hit beyond the window of the
request's first new token is not taken at all (its entry counts as released from the start).
A block whose parent entry was released is never registered: the parent object may by then be
another request's block, and a parent link must name the block matched one level up.

Attention sinks (``sinks`` S tokens, ``cache_window`` W tokens; StreamingLLM, MLC's
``attention_sink_size``): a request's cache holds at most ceil(W / block_size) blocks, its first
S / block_size blocks (the sinks, S a whole number of blocks) and its most recent ones, and its
table is that cache, compacted: entry ``i`` holds *cache* positions ``i * block_size ..``. When a
step's tokens would need more blocks, ``allocate_slots`` drops the oldest blocks after the sinks
(``_evict``, back to the pool at once) and the later entries move up, so every kept key after the
sinks now sits ``block_size`` cache positions earlier per dropped block: the runner re-rotates
them (``ScheduledSeq.num_shifted_tokens``) and runs a token at text position p at cache position
p - ``num_evicted_tokens``. Only full, computed blocks are dropped, so a step may run at most
``max_step_tokens`` tokens of a request (the scheduler caps it). The attention kernels see an
ordinary contiguous sequence. Re-rotated K/V depend on more than the tokens before them, so no
block of such a request is ever shared: prefix caching is off with sinks.
"""
from __future__ import annotations

from collections.abc import Sequence

from sluice.engine.kv_cache.block_pool import BlockPool, BlockPoolStats, KVBlock
from sluice.engine.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Hash of one full block. ``extra_keys`` is for anything besides the tokens that changes the
    KV (an adapter id, image hashes); no request field does so today, so callers pass ``()``."""
    return hash((parent_hash, tuple(token_ids), extra_keys))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, sinks: int = 0, cache_window: int | None = None) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: must be a positive integer, got {block_size!r}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window: must be None or a positive integer, got {sliding_window!r}")
        self._check_sinks(block_size, sliding_window, sinks, cache_window)
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.sinks = sinks
        self.cache_window = cache_window
        self._sink_blocks = sinks // block_size
        self._cache_blocks = 0 if cache_window is None else -(-cache_window // block_size)
        self.enable_prefix_caching = enable_prefix_caching and not sinks   # module doc: never shared
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_hashes: dict[str, list[int]] = {}        # hashes of the request's full blocks
        self._req_num_registered: dict[str, int] = {}      # leading blocks past registration
        self._req_num_released: dict[str, int] = {}        # leading entries out of the window
        self._req_num_evicted: dict[str, int] = {}         # sinks: blocks dropped after the sinks
        self._query_tokens = 0
        self._hit_tokens = 0

    @staticmethod
    def _check_sinks(block_size: int, sliding_window: int | None, sinks: int, cache_window: int | None) -> None:
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks: must be a non-negative integer, got {sinks!r}")
        if not sinks:
            if cache_window is not None:
                raise ValueError("cache_window: applies only with sinks")
            return
        if sliding_window is not None:
            raise ValueError("sliding_window: with sinks the kernels see no window (cache_window is the cache's size)")
        if sinks % block_size:
            raise ValueError(f"sinks: {sinks} tokens are not a whole number of blocks of {block_size}")
        if cache_window is None or -(-cache_window // block_size) < sinks // block_size + 2:
            raise ValueError(f"cache_window: must hold the {sinks} sinks and two blocks of {block_size} tokens "
                             f"after them, got {cache_window!r}")

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free plus evictable cached blocks."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt(-plus-output) tokens served from the cache over tokens looked up, at admission."""
        return self._hit_tokens / self._query_tokens if self._query_tokens else 0.0

    def stats(self) -> BlockPoolStats:
        return self.pool.stats()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's whole table (released entries included: they are never read)."""
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def num_evicted_tokens(self, request_id: str) -> int:
        """Sinks: tokens dropped from the request's cache after its sinks (text position less
        cache position of every later token); 0 without sinks."""
        return self._req_num_evicted.get(request_id, 0) * self.block_size

    @property
    def max_step_tokens(self) -> int | None:
        """Sinks: the most tokens one step may run of a request, so that dropping full blocks
        after the sinks always makes room: ceil(W / block_size) blocks of the cache less the sinks
        and a partly filled block, + 1. None: no bound."""
        if not self.sinks:
            return None
        return self._cache_blocks * self.block_size - self.sinks - self.block_size + 1

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference on (its table less the released entries)."""
        return len(self._req_blocks.get(request_id, ())) - self._req_num_released.get(request_id, 0)

    def num_out_of_window(self, num_computed: int) -> int:
        """Leading blocks that no query at position >= ``num_computed`` reads: those wholly before
        position num_computed - window + 1 (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed - self.sliding_window + 1) // self.block_size)

    def max_blocks_for(self, num_tokens: int, num_new_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds while it runs at most
        ``num_new_tokens`` tokens a step: all of them, or with a window the window's and the
        step's (ceil((window - 1 + new) / block_size) + 1)."""
        every = -(-num_tokens // self.block_size)
        if self.sinks:
            return min(every, self._cache_blocks)
        if self.sliding_window is None:
            return every
        return min(every, -(-(self.sliding_window - 1 + num_new_tokens) // self.block_size) + 1)

    # ---- prefix cache ----------------------------------------------------------------------
    def _block_hashes(self, request: Request, token_ids: list[int], num_full: int) -> list[int]:
        """The request's full-block hashes up to ``num_full``, extended incrementally."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], ()))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks that prefixes the request's tokens, leaving at least
        one token to compute so that the last position's logits exist."""
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hashes = self._block_hashes(request, tokens, max_blocks)
        bs, hits, parent = self.block_size, [], None
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], tokens[i * bs:(i + 1) * bs], parent)
            if block is None:
                break
            hits.append(block)
            parent = block
        return [b.block_id for b in hits], len(hits) * bs

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # ---- allocation ------------------------------------------------------------------------
    def _check_hits(self, request: Request, computed_blocks: Sequence[int],
                    num_computed_from_cache: int) -> list[KVBlock]:
        if not computed_blocks and not num_computed_from_cache:
            return []
        if self._req_blocks.get(request.request_id) or request.num_computed_tokens:
            raise ValueError(f"computed_blocks: request {request.request_id!r} already has blocks "
                             "or computed tokens; prefix hits apply only at admission")
        if num_computed_from_cache != len(computed_blocks) * self.block_size:
            raise ValueError(f"num_computed_from_cache: {num_computed_from_cache} is not "
                             f"{len(computed_blocks)} blocks x {self.block_size} tokens")
        blocks = [self.pool.blocks[i] for i in computed_blocks]
        stale = [b.block_id for b in blocks if b.block_hash is None]
        if stale:
            raise ValueError(f"computed_blocks: blocks {stale} are no longer cached")
        return blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (),
                       num_computed_from_cache: int = 0, num_lookahead_tokens: int = 0) -> list[int] | None:
        """Makes the request's table cover its computed tokens, the prefix hit, ``num_new_tokens``
        and ``num_lookahead_tokens`` draft slots. Returns the ids of newly taken blocks (hits not
        included), or None -- with nothing changed -- when the pool cannot provide them."""
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"num_new_tokens: must be >= 0 (lookahead too), got "
                             f"{num_new_tokens} and {num_lookahead_tokens}")
        hits = self._check_hits(request, computed_blocks, num_computed_from_cache)
        if self.sinks:
            return self._allocate_with_sinks(request, num_new_tokens + num_lookahead_tokens)
        rid = request.request_id
        held = self._req_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + num_computed_from_cache
        total = num_computed + num_new_tokens + num_lookahead_tokens
        num_needed = max(0, -(-total // self.block_size) - len(held) - len(hits))
        # Blocks behind the window of this step's first token are released even when the
        # allocation then fails: no step reads them again. Hits behind it are not taken.
        out = self.num_out_of_window(num_computed)
        if held:
            self._release_out_of_window(rid, out)
        taken = hits[out:] if hits else hits
        # Hits that are cached-but-free sit in the free list: taking them shrinks what is left.
        available = self.pool.num_free - sum(1 for b in taken if b.ref_cnt == 0)
        if num_needed > available:
            return None
        if rid not in self._req_blocks:
            self._query_tokens += request.num_tokens
            self._hit_tokens += num_computed_from_cache
            self._req_num_registered[rid] = len(hits)
            self._req_num_released[rid] = min(out, len(hits))
        self.pool.touch(taken)
        new_blocks = self.pool.take_new(num_needed)
        blocks = self._req_blocks.setdefault(rid, [])
        blocks.extend(hits)
        blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def _allocate_with_sinks(self, request: Request, num_tokens: int) -> list[int] | None:
        """``allocate_slots`` with sinks (module doc): the oldest full blocks after the sinks are
        dropped when the cache would otherwise outgrow ``cache_window``."""
        rid, bs = request.request_id, self.block_size
        held = self._req_blocks.get(rid, [])
        evicted = self._req_num_evicted.get(rid, 0)
        length = request.num_computed_tokens - evicted * bs          # tokens in the cache
        need = -(-(length + num_tokens) // bs)
        drop = max(0, need - self._cache_blocks)
        if drop and drop > length // bs - self._sink_blocks:
            raise ValueError(f"num_new_tokens: {num_tokens} tokens of request {rid!r} do not fit a cache of "
                             f"{self._cache_blocks} blocks with {self._sink_blocks} sink blocks (at most "
                             f"{self.max_step_tokens} a step)")
        num_needed = max(0, need - len(held))       # dropping shortens both the need and the table
        if num_needed > self.pool.num_free + drop:    # the dropped blocks are free again first
            return None
        if rid not in self._req_blocks:
            self._query_tokens += request.num_tokens
        blocks = self._req_blocks.setdefault(rid, [])
        if drop:
            first = self._sink_blocks
            self.pool.release(blocks[first:first + drop])
            del blocks[first:first + drop]
            self._req_num_evicted[rid] = evicted + drop
        new_blocks = self.pool.take_new(num_needed)
        blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def _release_out_of_window(self, rid: str, out: int) -> None:
        """Releases the request's leading blocks up to ``out`` (those left behind its window),
        oldest first, so that the oldest are evicted first."""
        blocks, done = self._req_blocks[rid], self._req_num_released.get(rid, 0)
        out = min(out, len(blocks))
        if out > done:
            self.pool.release(blocks[done:out])
            self._req_num_released[rid] = out

    def _register_full_blocks(self, request: Request, num_known_computed: int) -> None:
        """Registers blocks that are full of known tokens once this step has run."""
        rid = request.request_id
        start, num_full = self._req_num_registered[rid], num_known_computed // self.block_size
        if num_full <= start:
            return
        tokens = request.all_token_ids
        hashes = self._block_hashes(request, tokens, num_full)
        blocks, bs = self._req_blocks[rid], self.block_size
        released = self._req_num_released.get(rid, 0)
        for i in range(start, num_full):
            if released and i <= released:
                break     # the block or its parent entry is no longer ours (module doc)
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix hit: already registered
            parent = blocks[i - 1] if i else None
            if parent is not None and parent.block_hash is None:
                break     # the chain is broken (a hash was taken): later blocks cannot be found
            self.pool.register(block, hashes[i], tokens[i * bs:(i + 1) * bs], parent)
        # Failures are permanent for this request, so never retry them.
        self._req_num_registered[rid] = num_full

    def free(self, request: Request) -> None:
        """Releases the request's blocks, last block first so that tail blocks are evicted before
        the shared prefix. Safe to call for a request holding nothing."""
        rid = request.request_id
        blocks = self._req_blocks.pop(rid, [])
        released = self._req_num_released.pop(rid, 0)
        self._req_num_evicted.pop(rid, None)
        self._req_hashes.pop(rid, None)
        self._req_num_registered.pop(rid, None)
        self.pool.release(reversed(blocks[released:]))

    def check_invariants(self) -> None:
        """Pool invariants plus: every block's ref count equals the number of request tables that
        hold it. Raises AssertionError naming what is wrong."""
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for rid, blocks in self._req_blocks.items():
            for b in blocks[self._req_num_released.get(rid, 0):]:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        wrong = [(b.block_id, b.ref_cnt, refs.get(b.block_id, 0))
                 for b in self.pool.created if b.ref_cnt != refs.get(b.block_id, 0)]
        if wrong:
            raise AssertionError("KV ref counts differ from request tables (block, ref, owners): "
                                 f"{wrong[:8]}")
