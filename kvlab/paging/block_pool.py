"""BlockPool: the paged KV cache's allocator.

The cache is cut into ``num_blocks`` physical blocks of ``block_size`` token slots each. A
sequence owns a *block table*: the list of physical block ids holding its tokens in order,
so token ``pos`` lives in block ``block_table[pos // block_size]`` at offset
``pos % block_size``, i.e. in physical slot ``block_table[pos // block_size] * block_size +
pos % block_size``. Blocks are taken from a free queue only when a sequence's last block is
full, so at most ``block_size - 1`` slots per sequence are ever wasted.

Sharing (chapters 3 and 4) adds three things:

* **reference counts**: ``fork`` lets a child share every block of its parent; a block goes
  back to the free queue when its last holder frees it;
* **copy-on-write**: appending to a sequence whose partly filled last block is shared first
  moves it to a private copy and records ``(src, dst)`` in ``pending_copies``, which the
  engine hands to :func:`kvlab.kernels.copy_blocks` before the next forward pass;
* **prefix caching** (``enable_prefix_caching=True``): every full block is registered under
  its chained hash (:mod:`kvlab.paging.prefix_hash`); a new sequence reuses the longest run of
  cached blocks that starts its prompt; freed cached blocks stay reusable until evicted,
  least recently freed first (a sequence's tail before its head).

A **host tier** (chapter 9, :meth:`BlockPool.attach_host_tier`) keeps what eviction drops: each
evicted cached block is reported to it (``save(block, hash)``) before the block is reused, and
a prompt's cache hit goes on through the hashes the tier holds: :meth:`BlockPool.allocate`
takes device blocks for them, registers them, and has the tier record the copies back
(``take(hashes)``, ``restore(host_blocks, device_blocks)``). Without a tier nothing changes.

Every method checks its arguments and the free count *before* changing anything: an error
leaves the pool exactly as it was.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from kvlab.errors import OutOfBlocksError, SharedBlockWriteError, UnknownSequenceError
from kvlab.validation import check_bool, check_count  # noqa: F401  (check_count: imported from here too)
from kvlab.paging.prefix_hash import check_salt, hash_blocks, token_bytes


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Physical slots of the tokens at positions ``start .. start + num_tokens - 1``."""
    end = start + num_tokens
    if end > len(block_table) * block_size:
        raise ValueError(
            f"positions up to {end - 1} need {blocks_needed(end, block_size)} blocks, "
            f"the block table has {len(block_table)}"
        )
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


class BlockPool:
    """Fixed pool of KV-cache blocks with per-sequence block tables.

    >>> pool = BlockPool(num_blocks=8, block_size=4)
    >>> pool.allocate("a", 6)        # two blocks for six tokens
    [0, 1]
    >>> pool.append("a", 3)          # fills block 1, then needs one more
    [2]
    >>> pool.slot_mapping("a", start=6, num_tokens=3)
    [6, 7, 8]
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False):
        check_count("num_blocks", num_blocks, minimum=1)
        check_count("block_size", block_size, minimum=1)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))  # free, holding no cached KV
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[object, list[int]] = {}
        self.seq_lens: dict[object, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), not yet copied
        # prefix caching
        self.enable_prefix_caching = enable_prefix_caching
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}                 # hash -> block holding that KV
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recent first
        self.seq_tokens: dict[object, list[int]] = {}
        self.seq_salts: dict[object, object] = {}
        self.seq_hashes: dict[object, list[bytes]] = {}           # hashes of its full blocks
        self.num_cached_tokens: dict[object, int] = {}            # prompt tokens found in the cache
        self.host_tier = None              # where evicted cached blocks go (chapter 9), if anywhere

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached free blocks plus evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def capacity(self) -> int:
        """Token slots in the whole pool."""
        return self.num_blocks * self.block_size

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.block_tables

    def block_table(self, seq_id) -> list[int]:
        return list(self._table(seq_id))

    def seq_len(self, seq_id) -> int:
        self._table(seq_id)
        return self.seq_lens[seq_id]

    def can_append(self, seq_id, num_tokens: int = 1) -> bool:
        return self._new_blocks_for(seq_id, num_tokens) <= self.num_free_blocks

    def computed_blocks(self, token_ids, salt=None) -> list[int]:
        """The cached blocks :meth:`allocate` would reuse for prompt ``token_ids``; changes nothing.

        The longest run of cached full blocks that starts the prompt, capped at
        ``(len(token_ids) - 1) // block_size`` blocks so the last prompt token is computed (vLLM's
        ``get_computed_blocks``). Empty without prefix caching or for an empty prompt.
        """
        num_tokens = len(token_ids)
        if not self.enable_prefix_caching or num_tokens == 0:
            return []
        reusable = (num_tokens - 1) // self.block_size
        return self._cached_prefix(hash_blocks(token_ids[:reusable * self.block_size], self.block_size, salt))

    def num_cached_blocks(self, token_ids, salt=None) -> int:
        """Blocks of the cache hit :meth:`allocate` would find for prompt ``token_ids``: those of
        :meth:`computed_blocks`, and with a host tier the chain goes on through the hashes the
        tier holds (capped the same way). Changes nothing."""
        num_tokens = len(token_ids)
        if not self.enable_prefix_caching or num_tokens == 0:
            return 0
        return len(self._prefix_chain(token_ids[:(num_tokens - 1) // self.block_size * self.block_size], salt))

    def slot_mapping(self, seq_id, start: int, num_tokens: int) -> list[int]:
        """Physical slots to *write* positions ``start .. start + num_tokens - 1`` of ``seq_id``.

        Refuses slots in a block other sequences share: writing there would change what
        they read (``append`` copies such a block first).
        """
        table = self._table(seq_id)
        check_count("start", start)
        check_count("num_tokens", num_tokens)
        if start + num_tokens > self.seq_lens[seq_id]:
            raise ValueError(
                f"positions {start}..{start + num_tokens - 1} are beyond sequence {seq_id!r} "
                f"of length {self.seq_lens[seq_id]}"
            )
        written_blocks = range(start // self.block_size, blocks_needed(start + num_tokens, self.block_size))
        for i in written_blocks if num_tokens else ():
            if self.ref_counts[table[i]] > 1:
                raise SharedBlockWriteError(
                    f"position {max(start, i * self.block_size)} of sequence {seq_id!r} is in block {table[i]}, "
                    f"shared by {self.ref_counts[table[i]]} sequences: writing it would bypass copy-on-write"
                )
        return slot_mapping(table, start, num_tokens, self.block_size)

    # -- changes ------------------------------------------------------------------------
    def allocate(self, seq_id, num_tokens: int, token_ids=None, salt=None, cache: bool = True) -> list[int]:
        """Start sequence ``seq_id`` with room for ``num_tokens`` tokens; returns its block table.

        With prefix caching, ``token_ids`` (the prompt) are required: the longest run of
        cached full blocks that starts the prompt is reused, at most ``num_tokens - 1``
        tokens' worth, so the last prompt token is always computed (its logits are needed).
        ``num_cached_tokens[seq_id]`` says how many tokens were found (with a host tier, blocks
        brought back from the host count: :meth:`num_cached_blocks`). Its own full blocks are
        registered in the cache at once, or with ``cache=False`` only when :meth:`cache_blocks`
        says their K/V has been computed (the engine's way: a failed step leaves no block behind
        that a later prompt would "hit" before its K/V exists).
        """
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it first")
        check_count("num_tokens", num_tokens)
        check_salt(salt)
        check_bool("cache", cache)
        self._check_capacity(seq_id, num_tokens)
        hits, chain = [], []
        if self.enable_prefix_caching:
            self._check_token_ids(token_ids, num_tokens)
            if self.host_tier is None:
                hits = self.computed_blocks(token_ids, salt)     # the one lookup, also the scheduler's
            else:      # the hit through both tiers: (device block, or None if on the host; hash)
                chain = self._prefix_chain(token_ids[:(num_tokens - 1) // self.block_size * self.block_size], salt)
                hits = [b for b, _ in chain if b is not None]
        needed = blocks_needed(num_tokens, self.block_size) - len(hits)
        available = self.num_free_blocks - sum(1 for b in hits if b in self.evictable)
        if needed > available:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {needed} more blocks, {available} are free")
        for block in hits:
            self._hold(block)
        if chain:
            hits = self._bring_back(chain)          # held too: new blocks for the host's hashes
        self.block_tables[seq_id] = hits + [self._take_free_block()
                                            for _ in range(blocks_needed(num_tokens, self.block_size) - len(hits))]
        self.seq_lens[seq_id] = num_tokens
        if self.enable_prefix_caching:
            self.seq_tokens[seq_id] = [int(t) for t in token_ids]
            self.seq_salts[seq_id] = salt
            self.seq_hashes[seq_id] = []
            self.num_cached_tokens[seq_id] = len(hits) * self.block_size
            self._register_full_blocks(seq_id, upto=None if cache else len(hits) * self.block_size)
        return self.block_table(seq_id)

    def cache_blocks(self, seq_id, num_computed_tokens: int) -> None:
        """The K/V of the first ``num_computed_tokens`` tokens of ``seq_id`` is in the cache:
        register its full blocks among them (those not registered yet)."""
        self._table(seq_id)
        check_count("num_computed_tokens", num_computed_tokens)
        if num_computed_tokens > self.seq_lens[seq_id]:
            raise ValueError(f"sequence {seq_id!r} has {self.seq_lens[seq_id]} tokens, not {num_computed_tokens}")
        if self.enable_prefix_caching:
            self._register_full_blocks(seq_id, upto=num_computed_tokens)

    def append(self, seq_id, num_tokens: int = 1, token_ids=None, cache: bool = True) -> list[int]:
        """Grow ``seq_id`` by ``num_tokens`` slots; returns the blocks newly taken (often none).

        If the last block is partly filled and shared, it is first replaced by a private
        copy (copy-on-write): the pair is recorded in ``pending_copies``. With prefix caching,
        ``token_ids`` of the new tokens are required, so filled blocks can be hashed.
        """
        needed = self._new_blocks_for(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {needed} more blocks, {self.num_free_blocks} are free"
            )
        if self.enable_prefix_caching:
            self._check_token_ids(token_ids, num_tokens)
        check_bool("cache", cache)
        table = self.block_tables[seq_id]
        new_blocks = []
        if self._needs_copy_on_write(seq_id, num_tokens):
            shared = table[-1]
            table[-1] = self._take_free_block()
            self.ref_counts[shared] -= 1          # still >= 1: others hold it
            # If `shared` is itself a copy not made yet, copy from its source instead.
            source = next((src for src, dst in self.pending_copies if dst == shared), shared)
            self.pending_copies.append((source, table[-1]))
            new_blocks.append(table[-1])
        grown = [self._take_free_block() for _ in range(needed - len(new_blocks))]
        table.extend(grown)
        self.seq_lens[seq_id] += num_tokens
        if self.enable_prefix_caching:
            self.seq_tokens[seq_id] += [int(t) for t in token_ids]
            if cache:
                self._register_full_blocks(seq_id)
        return new_blocks + grown

    def truncate(self, seq_id, num_tokens: int) -> list[int]:
        """Cut ``seq_id`` back to its first ``num_tokens`` tokens (speculative decoding's rollback:
        the rejected draft tokens' slots are given up); returns the blocks nobody holds any more.

        Blocks left empty are released as by :meth:`free`; the partly filled last block stays.
        Refuses to cut into a block registered in the prefix cache: its hash promises its
        tokens, and the slots cut would be written again with others.
        """
        table = self._table(seq_id)
        check_count("num_tokens", num_tokens)
        length = self.seq_lens[seq_id]
        if num_tokens > length:
            raise ValueError(f"num_tokens={num_tokens} is more than sequence {seq_id!r}'s {length} tokens: "
                             f"truncate only cuts")
        if self.enable_prefix_caching and num_tokens < len(self.seq_hashes[seq_id]) * self.block_size:
            raise ValueError(f"cannot cut sequence {seq_id!r} to {num_tokens} tokens: its first "
                             f"{len(self.seq_hashes[seq_id]) * self.block_size} are in cached blocks")
        keep = blocks_needed(num_tokens, self.block_size)
        dropped = table[keep:]
        del table[keep:]
        self.seq_lens[seq_id] = num_tokens
        if self.enable_prefix_caching:
            del self.seq_tokens[seq_id][num_tokens:]
        return self._release(dropped)

    def fork(self, parent, child) -> list[int]:
        """Make ``child`` a new sequence sharing every block of ``parent``; returns its table."""
        table = self._table(parent)
        if child in self.block_tables:
            raise ValueError(f"sequence {child!r} already exists: fork needs a new id")
        for block in table:
            self.ref_counts[block] += 1
        self.block_tables[child] = list(table)
        self.seq_lens[child] = self.seq_lens[parent]
        if self.enable_prefix_caching:
            self.seq_tokens[child] = list(self.seq_tokens[parent])
            self.seq_salts[child] = self.seq_salts[parent]
            self.seq_hashes[child] = list(self.seq_hashes[parent])
            self.num_cached_tokens[child] = self.num_cached_tokens[parent]
        return list(table)

    def free(self, seq_id) -> list[int]:
        """Drop ``seq_id``'s hold on its blocks; returns those nobody holds any more.

        Released blocks that carry a cached hash stay reusable (evictable), tail first, so
        that under memory pressure a sequence's tail is evicted before its shared head.
        """
        table = self._table(seq_id)
        for attrs in (self.block_tables, self.seq_lens, self.seq_tokens, self.seq_salts, self.seq_hashes,
                      self.num_cached_tokens):
            attrs.pop(seq_id, None)
        return self._release(table)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs recorded since the last call, for ``copy_blocks``."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def attach_host_tier(self, tier) -> None:
        """Keep evicted cached blocks in ``tier`` (a :class:`~kvlab.engine.offload.HostPrefixCache`)
        and bring them back on a hit (see the module docstring). Only on an empty pool with
        prefix caching."""
        if not self.enable_prefix_caching:
            raise ValueError("a host tier keeps prefix-cache blocks: it needs enable_prefix_caching=True")
        if self.block_tables or self.cached_blocks:
            raise ValueError("attach the host tier before the pool is used")
        missing = [m for m in ("lookup", "save", "take", "restore", "take_transfers", "next_step", "discard", "clear")
                   if not callable(getattr(tier, m, None))]
        if missing:
            raise TypeError(f"tier must be a HostPrefixCache; a {type(tier).__name__} has no {', '.join(missing)}")
        self.host_tier = tier

    def forget(self, blocks) -> None:
        """Drop ``blocks`` from the prefix cache: their K/V is not what their hash promises (a
        step that was to copy it failed). Unheld ones become plain free blocks."""
        blocks = list(blocks)
        for block in blocks:
            if check_count("block", block) >= self.num_blocks:
                raise ValueError(f"block {block} is out of range: the pool has {self.num_blocks} blocks")
        for block in blocks:
            if self.block_hashes[block] is None:
                continue
            self._uncache(block)
            if block in self.evictable:
                del self.evictable[block]
                self.free_blocks.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (the host tier's too). Only possible when no block is in use:
        returns success."""
        if any(self.ref_counts):
            return False
        if self.host_tier is not None:
            self.host_tier.clear()
        self.cached_blocks.clear()
        self.block_hashes = [None] * self.num_blocks
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()
        return True

    # -- helpers ------------------------------------------------------------------------
    def _table(self, seq_id) -> list[int]:
        try:
            return self.block_tables[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence id {seq_id!r} (never allocated, or freed)") from None

    def _check_capacity(self, seq_id, num_tokens: int) -> None:
        if num_tokens > self.capacity:
            raise ValueError(
                f"sequence {seq_id!r} would hold {num_tokens} tokens, more than the pool's "
                f"{self.capacity} slots ({self.num_blocks} blocks x {self.block_size})"
            )

    def _check_token_ids(self, token_ids, num_tokens: int) -> None:
        if token_ids is None or len(token_ids) != num_tokens:
            got = "none" if token_ids is None else len(token_ids)
            raise ValueError(f"with prefix caching, token_ids must give the {num_tokens} new tokens, got {got}")
        token_bytes(token_ids)  # raises for ids that can't be hashed, before anything changes

    def _needs_copy_on_write(self, seq_id, num_tokens: int) -> bool:
        table, length = self.block_tables[seq_id], self.seq_lens[seq_id]
        return num_tokens > 0 and length % self.block_size != 0 and self.ref_counts[table[-1]] > 1

    def _new_blocks_for(self, seq_id, num_tokens: int) -> int:
        check_count("num_tokens", num_tokens)
        table = self._table(seq_id)
        new_len = self.seq_lens[seq_id] + num_tokens
        self._check_capacity(seq_id, new_len)
        cow = self._needs_copy_on_write(seq_id, num_tokens)
        return blocks_needed(new_len, self.block_size) - len(table) + cow

    def _take_free_block(self) -> int:
        """A free block for new KV: a never-cached one if any, else evict the least recent."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            if self.host_tier is not None:      # its K/V goes to the host before the block is reused
                self.host_tier.save(block, self.block_hashes[block])
            self._uncache(block)
        else:
            raise OutOfBlocksError("no free block (callers check the free count first)")
        self.ref_counts[block] = 1
        return block

    def _release(self, blocks: list[int]) -> list[int]:
        """Drop one hold on each of ``blocks`` (a sequence's, in table order); returns those
        nobody holds now. Cached ones stay reusable (evictable), tail first."""
        released = []
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                released.append(block)
        for block in reversed(released):
            if self.block_hashes[block] is not None:
                self.evictable[block] = None
        self.free_blocks.extend(b for b in released if self.block_hashes[b] is None)
        if self.pending_copies and released:      # a copy into a block given back is moot
            self.pending_copies = [(src, dst) for src, dst in self.pending_copies if dst not in released]
        return released

    def _hold(self, block: int) -> None:
        """One more holder for a cached block; a freed one is revived, hash and all."""
        self.evictable.pop(block, None)
        self.ref_counts[block] += 1

    def _cached_prefix(self, hashes: list[bytes]) -> list[int]:
        blocks = []
        for h in hashes:
            block = self.cached_blocks.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _prefix_chain(self, token_ids, salt) -> list[tuple[int | None, bytes]]:
        """``(device block, hash)`` for each full block of ``token_ids`` while its hash is cached on
        the device or (block None) in the host tier."""
        chain = []
        for h in hash_blocks(token_ids, self.block_size, salt):
            block = self.cached_blocks.get(h)
            if block is None and (self.host_tier is None or self.host_tier.lookup(h) is None):
                break
            chain.append((block, h))
        return chain

    def _bring_back(self, chain: list[tuple[int | None, bytes]]) -> list[int]:
        """Device blocks for a prefix chain whose device blocks are held: the host tier's hashes
        get new blocks, and the tier records the copies into them. Their entries leave the tier
        first, so that what taking the blocks evicts cannot push them out."""
        host_blocks = self.host_tier.take([h for b, h in chain if b is None])
        blocks = [self._take_free_block() if b is None else b for b, _ in chain]
        self.host_tier.restore(host_blocks, [b for b, (old, _) in zip(blocks, chain) if old is None])
        return blocks

    def _register_full_blocks(self, seq_id, hashes: list[bytes] | None = None, upto: int | None = None) -> None:
        """Hash the full blocks of ``seq_id`` not hashed yet (among its first ``upto`` tokens),
        and cache them under those hashes."""
        done, bs = self.seq_hashes[seq_id], self.block_size
        num_full = (self.seq_lens[seq_id] if upto is None else upto) // bs
        if num_full <= len(done):
            return
        if hashes is None:
            parent = done[-1] if done else None
            tokens = self.seq_tokens[seq_id][len(done) * bs:num_full * bs]
            hashes = done + hash_blocks(tokens, bs, self.seq_salts[seq_id], parent)
        table = self.block_tables[seq_id]
        for i in range(len(done), num_full):
            if hashes[i] not in self.cached_blocks:   # an equal block cached earlier wins
                self.cached_blocks[hashes[i]] = table[i]
                self.block_hashes[table[i]] = hashes[i]
        self.seq_hashes[seq_id] = hashes[:num_full]

    def _uncache(self, block: int) -> None:
        """Evict: the block's hash stops naming it. Its descendants' hashes chain through this
        hash, so no lookup can reach them any more: no cascade walk is needed."""
        h = self.block_hashes[block]
        if h is not None and self.cached_blocks.get(h) == block:
            del self.cached_blocks[h]
        self.block_hashes[block] = None
