"""Paged KV bookkeeping: which blocks are free, who holds which, which hold a known prefix.
Pure Python, no torch.

The pool itself (per-layer tensors of shape (kv_heads, num_blocks, block_size, head_dim)) lives
in the workers; this class only hands out block ids. A request's block table maps its token
position p to slot block_ids[p // block_size] * block_size + p % block_size.

Prefix caching: once a block is full and computed, its content is named by a hash chained
through the previous block's hash (and a salt, so tenants can be kept apart). A new request
takes every cached block of its prefix read-only (reference counts); a block is only ever
written by the one request that filled it. Blocks nobody holds keep their content and are
reused least-recently-freed first, so a popular prefix survives while the pool has room.

With an index attached (recovery/block_index.py) every registration and every eviction is mirrored in
it, so that the engine core taking over after this one dies can adopt the cached blocks.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable

from tokstream.engine.request import Request


CACHED_RUN = re.compile(b"\x01+")


def chain_hash(parent: bytes, tokens: list[int], salt: str) -> bytes:
    """Name of a full block: its tokens, everything before it (parent) and the salt."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(salt.encode())
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        """Blocks holding nothing worth keeping."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Blocks nobody holds that still hold a cached prefix, least recently freed first."""
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._cached_marks = bytearray(num_blocks)
        """1 where a block is in _hash_of, kept alongside it so the state snapshot finds the
        cached blocks' runs at C speed (/v1/state is polled every second)."""
        self.prefix_queries = 0
        """Prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries)."""
        self.prefix_hits = 0
        """Of those, tokens found (vllm:prefix_cache_hits)."""
        self.index = None
        """A BlockIndex mirroring the prefix cache's map (attach_index), or None."""
        self.blocks_handed_out = 0
        """Blocks given to a request since this manager was made (adopt needs none)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can be given now (truly free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is registered in the prefix cache (held or evictable)."""
        return len(self._hash_of)

    @property
    def cached_runs(self) -> list[list[int]]:
        """The blocks registered in the prefix cache (held or evictable) as [first, count]
        runs of consecutive ids, ascending."""
        return [[m.start(), m.end() - m.start()] for m in CACHED_RUN.finditer(self._cached_marks)]

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so that request can hold num_new_tokens more computed tokens."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(request, num_new_tokens) + reserve <= self.num_free_blocks

    def match_prefix(self, request: Request) -> int:
        """Give a request with no blocks every cached block of its prefix; returns the tokens
        now counted as computed. At least one token is always left to compute, so the model
        produces the logits of the next one."""
        if not self.enable_caching or request.block_ids or request.scores_prompt:
            return 0
        usable = (request.num_tokens - 1) // self.block_size
        self.prefix_queries += request.num_tokens
        parent = b""
        hashes = []
        for index in range(usable):
            start = index * self.block_size
            parent = chain_hash(parent, request.token_slice(start, start + self.block_size),
                                request.cache_salt)
            block_id = self._block_of.get(parent)
            if block_id is None:
                break
            hashes.append(parent)
            self._hold(block_id)
            request.block_ids.append(block_id)
        request.block_hashes = hashes
        request.num_computed_tokens = len(hashes) * self.block_size
        self.prefix_hits += request.num_computed_tokens
        return request.num_computed_tokens

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of a waiting request's prefix the cache holds now, as match_prefix would
        count them, without taking the blocks. The chain hashes stay on the request, so asking
        again each step costs dict lookups, not hashing."""
        if (not self.enable_caching or request.block_ids or request.scores_prompt
                or request.swapped_block_ids):
            return 0
        usable = (request.num_tokens - 1) // self.block_size
        count = 0
        while count < usable:
            if self.prefix_chain(request, count + 1)[count] not in self._block_of:
                break
            count += 1
        return count * self.block_size

    def prefix_chain(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chain hashes of request's first num_blocks full blocks (at least), computed once
        and kept on the request (prefix_chain)."""
        chain = request.prefix_chain
        while len(chain) < num_blocks:
            start = len(chain) * self.block_size
            chain.append(chain_hash(chain[-1] if chain else b"",
                                    request.token_slice(start, start + self.block_size),
                                    request.cache_salt))
        return chain

    def blocks_in_flight(self, prefilling: Iterable[Request]) -> set[bytes]:
        """Chain hashes of the prompt blocks these requests are still to compute: a waiting
        request whose next uncached block is among them waits for it (prefix_in_flight)."""
        if not self.enable_caching:
            return set()
        pending: set[bytes] = set()
        for request in prefilling:
            usable = (request.num_tokens - 1) // self.block_size
            computed = request.num_computed_tokens // self.block_size
            if computed < usable:
                pending.update(self.prefix_chain(request, usable)[computed:usable])
        return pending

    def prefix_in_flight(self, request: Request, pending: set[bytes]) -> bool:
        """The next block of request's prefix that the cache lacks is being computed by a
        running request: starting now would compute it a second time."""
        if not pending or request.scores_prompt or request.swapped_block_ids:
            return False
        usable = (request.num_tokens - 1) // self.block_size
        count = self.cached_prefix_tokens(request) // self.block_size
        return count < usable and self.prefix_chain(request, count + 1)[count] in pending

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks request has filled since the last call (after a step)."""
        if not self.enable_caching:
            return
        full = request.num_computed_tokens // self.block_size
        parent = request.block_hashes[-1] if request.block_hashes else b""
        for index in range(len(request.block_hashes), full):
            start = index * self.block_size
            parent = chain_hash(parent, request.token_slice(start, start + self.block_size),
                                request.cache_salt)
            request.block_hashes.append(parent)
            block_id = request.block_ids[index]
            if parent not in self._block_of and block_id not in self._hash_of:
                self._register(block_id, parent)

    def allocate(self, request: Request, num_new_tokens: int, reserve: int = 0) -> list[int] | None:
        """Grow request's block table for num_new_tokens more tokens; None if the pool is short."""
        count = self.num_new_blocks(request, num_new_tokens)
        if count + reserve > self.num_free_blocks:
            return None
        new_ids = [self._take() for _ in range(count)]
        request.block_ids.extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        """Return request's blocks; a block goes back to the pool when nobody holds it."""
        # Reversed, so a sequence's tail (the least shareable part) is evicted first.
        for block_id in reversed(request.block_ids):
            self._release(block_id)
        request.block_ids = []
        request.block_hashes = []
        request.num_computed_tokens = 0

    def trim(self, request: Request) -> int:
        """Return request's blocks past those its computed tokens fill: blocks taken for
        drafted positions a speculative step rejected. Returns the blocks freed."""
        keep = self.blocks_for(request.num_computed_tokens)
        tail = request.block_ids[keep:]
        for block_id in reversed(tail):
            self._release(block_id)
        del request.block_ids[keep:]
        del request.block_hashes[keep:]  # hashes name full computed blocks: none is cut
        return len(tail)

    def _release(self, block_id: int) -> None:
        """One holder fewer; a block nobody holds is evictable (cached) or free."""
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if block_id in self._hash_of:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def reset(self) -> None:
        """Forget every block (the pool's contents are gone: its rank group was replaced).
        Every request must have given its blocks back first."""
        self.ref_counts = [0] * self.num_blocks
        self._free = deque(range(self.num_blocks))
        self._evictable.clear()
        self._hash_of.clear()
        self._cached_marks = bytearray(self.num_blocks)
        self._block_of.clear()
        if self.index is not None:
            self.index.clear_all()

    def attach_index(self, index, entries: dict[int, bytes]) -> int:
        """Register the blocks a dead engine core's index listed (entries: {block id: prefix
        hash}, from BlockIndex.claim) as cached prefixes nobody holds, and mirror the cache in
        index from now on. Only a manager that has handed out no block can adopt: its ranks
        have written nothing over what the index describes. Returns the blocks adopted."""
        if self.blocks_handed_out or self._hash_of or not self.enable_caching:
            index.clear_all()
            entries = {}
            for block_id, block_hash in self._hash_of.items():
                index.publish(block_id, block_hash)
        self.index = index
        adopted = set()
        for block_id, block_hash in sorted(entries.items()):
            if block_hash in self._block_of:
                index.clear(block_id)  # listed twice: the first is kept
                continue
            self._register(block_id, block_hash)
            self._evictable[block_id] = None
            adopted.add(block_id)
        self._free = deque(b for b in self._free if b not in adopted)
        return len(adopted)

    def check(self, holders: Iterable[Request], rehash: bool = True) -> list[str]:
        """What is wrong with the bookkeeping (empty when nothing is), given every request
        that may hold blocks: each block's reference count equals its holders; each block is
        exactly one of free, evictable or held; the prefix cache's two maps are each other's
        inverse; a registered block's hash is the one each holder computed for it, and (with
        rehash) each holder's hashes are those of its own tokens."""
        problems = []
        holders_of = [0] * self.num_blocks
        for request in holders:
            parent = b""
            for index, block_id in enumerate(request.block_ids):
                if not 0 <= block_id < self.num_blocks:
                    problems.append(f"{request.request_id} holds block {block_id}: no such block")
                    continue
                holders_of[block_id] += 1
                if index >= len(request.block_hashes):
                    continue
                own = request.block_hashes[index]
                registered = self._hash_of.get(block_id)
                if registered is not None and registered != own:
                    problems.append(f"block {block_id}: cached under another prefix than "
                                    f"{request.request_id}'s block {index}")
                if rehash:
                    start = index * self.block_size
                    parent = chain_hash(parent, request.token_slice(start, start
                                                                    + self.block_size),
                                        request.cache_salt)
                    if parent != own:
                        problems.append(f"{request.request_id} block {index}: its hash is not "
                                        "that of its tokens")
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        for block_id in range(self.num_blocks):
            count, held = self.ref_counts[block_id], holders_of[block_id]
            if count != held:
                problems.append(f"block {block_id}: reference count {count}, {held} holders")
            places = (block_id in free) + (block_id in evictable) + (count > 0 or held > 0)
            if places != 1:
                problems.append(f"block {block_id}: in {places} of free, evictable and held")
            if self._cached_marks[block_id] != (block_id in self._hash_of):
                problems.append(f"block {block_id}: cached mark disagrees with the cache")
        if not evictable <= self._hash_of.keys():
            problems.append("an evictable block holds no cached prefix")
        if free & self._hash_of.keys():
            problems.append("a free block is still registered in the prefix cache")
        if len(self._block_of) != len(self._hash_of) or any(
                self._block_of.get(h) != b for b, h in self._hash_of.items()):
            problems.append("the prefix cache's hash and block maps disagree")
        if self.index is not None and self.index.entries() != self._hash_of:
            problems.append("the block index lists other blocks than the prefix cache")
        return problems

    def _register(self, block_id: int, block_hash: bytes) -> None:
        """block_id holds the prefix named block_hash: enter it in the cache (and the index)."""
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self._cached_marks[block_id] = 1
        if self.index is not None:
            self.index.publish(block_id, block_hash)

    def _hold(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self.ref_counts[block_id] += 1

    def _take(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block_id)]
            self._cached_marks[block_id] = 0
        self.ref_counts[block_id] = 1
        self.blocks_handed_out += 1
        if self.index is not None:
            # Unlisted before any rank writes to it: a core that dies from here on must not
            # leave it named after its old prefix.
            self.index.clear(block_id)
        return block_id


class SwapSpace:
    """Host-memory blocks that hold preempted requests' KV in swap mode. Ids index the workers'
    host buffers (same per-layer layout as the pool); contents are never shared."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def reset(self) -> None:
        self._free = deque(range(self.num_blocks))

    def check(self, holders: Iterable[list[int]]) -> list[str]:
        """What is wrong (empty when nothing is): every host block is free or held by exactly
        one of holders (swapped-out requests' block lists)."""
        held = [b for block_ids in holders for b in block_ids]
        owners = held + list(self._free)
        if sorted(owners) != list(range(self.num_blocks)):
            return [f"host blocks: {len(self._free)} free and {len(held)} held of "
                    f"{self.num_blocks}, not each exactly once"]
        return []
