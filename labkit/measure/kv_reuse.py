"""KV reuse on a trace: how many prompt tokens a prefix cache of N blocks serves, under LRU and under Belady.

A prefix cache keeps the KV blocks of finished requests until the pool needs them back. Which block to give up
is the eviction policy: labkit's block manager (like vLLM's) evicts the least recently used one. How much does that
lose? Belady's rule, the clairvoyant optimum, evicts the block whose next use lies furthest in the future (never
used again first); no policy can hit more, so it is the upper bound to plot LRU against.

``replay`` runs a trace through a pool of ``num_blocks`` blocks with the block manager's rules, one request at a
time: a request reuses the leading run of its prompt's full blocks that are cached (never the whole prompt: its
last token must be computed), takes free blocks first and evicts only when none is left, registers each block once
it is full, and on finishing releases its blocks last first (so a prefix's tail goes before its head). With
``policy="lru"`` it gives the same hits as ``labkit.core.kv.block_manager.BlockManager`` driven the same way (tested);
with ``policy="belady"`` only the choice of victim changes. Introduced in notebook 06 (KV reuse across turns).
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from labkit.core.kv.block_manager import BlockManager

POLICIES = ("lru", "belady")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, as the prefix cache sees it. Notebook 06.

    ``block_hashes``: the chained hash of every block that is full once the request finishes (prompt and
    answer; the last answer token's K/V is never computed); ``num_lookup``: how many leading ones a hit may cover.
    """

    prompt_len: int
    output_len: int
    block_hashes: tuple[int, ...]
    num_lookup: int

    @property
    def num_computed(self) -> int:
        return self.prompt_len + self.output_len - 1


def block_trace(calls: Iterable[tuple[Sequence[int], Sequence[int]]], block_size: int) -> list[TraceRequest]:
    """(prompt ids, answer ids) per request, in order -> the trace ``replay`` takes (the block manager's hashes)."""
    hasher = BlockManager(1, block_size)  # its block_hashes is the one definition of a block's identity
    trace = []
    for prompt, answer in calls:
        if len(prompt) < 1 or len(answer) < 1:
            raise ValueError(f"each request needs a prompt and an answer of >= 1 token, got {len(prompt)} and "
                             f"{len(answer)}")
        tokens = list(prompt) + list(answer)
        num_full = (len(tokens) - 1) // block_size
        trace.append(TraceRequest(len(prompt), len(answer), tuple(hasher.block_hashes(tokens[: num_full * block_size])),
                                  (len(prompt) - 1) // block_size))
    return trace


@dataclass
class ReuseResult:
    """Prefix-cache hits of one replay. Notebook 06."""

    policy: str
    num_blocks: int
    block_size: int
    hit_tokens: list[int] = field(default_factory=list)  # per request: prompt tokens served from the cache
    prompt_tokens: list[int] = field(default_factory=list)
    num_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over all prompt tokens (the block manager's ``hit_rate``)."""
        total = sum(self.prompt_tokens)
        return sum(self.hit_tokens) / total if total else 0.0


class _Pool:
    """The pool's books during a replay: free blocks, cached blocks nobody holds, and the victim rule."""

    def __init__(self, trace: list[TraceRequest], num_blocks: int, policy: str) -> None:
        self.free = num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.mapped: set[int] = set()  # hashes held by a block (evictable or in use)
        self.policy = policy
        self.uses: dict[int, list[int]] = defaultdict(list)  # hash -> requests that may hit it, ascending
        self.depth: dict[int, int] = {}
        for r, req in enumerate(trace):
            for h in req.block_hashes[: req.num_lookup]:
                self.uses[h].append(r)
            for i, h in enumerate(req.block_hashes):
                self.depth[h] = i
        self.heap: list[tuple[float, int, int]] = []  # (-next use, -depth, hash): the furthest, deepest first
        self.key: dict[int, tuple[float, int]] = {}

    def next_use(self, h: int, after: int) -> float:
        uses = self.uses.get(h, [])
        i = bisect.bisect_right(uses, after)
        return uses[i] if i < len(uses) else float("inf")

    def make_evictable(self, h: int, now: int) -> None:
        self.evictable[h] = None
        if self.policy == "belady":
            self.rekey(h, now)

    def rekey(self, h: int, now: int) -> None:
        key = (-self.next_use(h, now), -self.depth[h])
        self.key[h] = key
        heapq.heappush(self.heap, (*key, h))

    def take(self) -> bool:
        """Take a block; True if that evicted a cached one."""
        if self.free:
            self.free -= 1
            return False
        if self.policy == "lru":
            victim, _ = self.evictable.popitem(last=False)
        else:
            while True:
                *key, victim = heapq.heappop(self.heap)
                if victim in self.evictable and tuple(key) == self.key[victim]:
                    break
            del self.evictable[victim]
        self.mapped.discard(victim)
        return True


def replay(trace: list[TraceRequest], num_blocks: int, block_size: int, policy: str = "lru") -> ReuseResult:
    """Run ``trace`` one request at a time through a prefix cache of ``num_blocks`` blocks. Notebook 06."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    pool = _Pool(trace, num_blocks, policy)
    result = ReuseResult(policy, num_blocks, block_size)
    for r, req in enumerate(trace):
        need = -(-req.num_computed // block_size)
        if need > num_blocks:
            raise ValueError(f"request {r} needs {need} blocks ({req.num_computed} tokens) but the pool has "
                             f"{num_blocks}")
        num_hits = 0
        for h in req.block_hashes[: req.num_lookup]:
            if h not in pool.mapped:
                break
            num_hits += 1
        for h in req.block_hashes[:num_hits]:
            del pool.evictable[h]  # in use now: not evictable
        if policy == "belady":  # cached blocks after the first miss were not used by this request: next use moves on
            for h in req.block_hashes[num_hits : req.num_lookup]:
                if h in pool.evictable:
                    pool.rekey(h, r)
        # the hash each of our blocks is registered under (None: a partial block, or a duplicate of a cached one)
        table: list[int | None] = list(req.block_hashes[:num_hits])
        attempted = num_hits
        for computed in range(req.prompt_len, req.num_computed + 1):  # the prompt, then one token per decode step
            while len(table) < -(-computed // block_size):
                result.num_evictions += pool.take()
                table.append(None)
            for i in range(attempted, computed // block_size):  # blocks that just filled up
                h = req.block_hashes[i]
                if h not in pool.mapped:  # a copy cached elsewhere keeps the hash (the block manager's setdefault)
                    pool.mapped.add(h)
                    table[i] = h
            attempted = max(attempted, computed // block_size)
        for h in reversed(table):  # last first: a prefix's tail becomes the first to go
            if h is None:
                pool.free += 1
            else:
                pool.make_evictable(h, r)
        result.hit_tokens.append(num_hits * block_size)
        result.prompt_tokens.append(req.prompt_len)
    return result
