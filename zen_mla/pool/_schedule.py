"""Splitting a ragged batch into pieces of similar cost and spreading them over the workers.

Cost of a sequence is its visible (query, key) pairs times its heads. A sequence costing more than
half a worker's fair share (and more than the smallest piece worth a hop) is split by heads, and
where there are fewer heads than pieces it needs (16 heads over 12 CCXs, or 8 heads per TP rank),
by blocks of queries of equal cost too, so one long sequence keeps every CCX busy; runs of cheap
sequences are packed together whole, up to one share (the kernel batches equal lengths), and pieces
go longest-first to the least-loaded worker (LPT: within 4/3 of the best makespan).

A block of queries `[a, b)` of a causal sequence is itself a bottom-right causal sequence: it sees
keys `[0, b + Sk - Sq)`, so a worker runs it like any other.
"""

from __future__ import annotations

import heapq
import itertools
import math

from ..attention.batch import visible_pairs
from ._messages import Piece

__all__ = ["Piece", "schedule"]


def _piece(
    q_cu: tuple[int, ...], kv_cu: tuple[int, ...], r0: int, r1: int, h0: int, h1: int, cost: int
) -> Piece:
    return Piece(
        r0,
        r1,
        h0,
        h1,
        q_cu[r0],
        q_cu[r1],
        kv_cu[r0],
        kv_cu[r1],
        tuple(c - q_cu[r0] for c in q_cu[r0 : r1 + 1]),
        tuple(c - kv_cu[r0] for c in kv_cu[r0 : r1 + 1]),
        cost,
    )


def _pairs_before(i: int, sq: int, sk: int, causal: bool) -> int:
    """Visible (query, key) pairs of query rows `[0, i)` (bottom-right causal)."""
    if not causal:
        return i * sk
    off = sk - sq
    if off >= 0:
        return i * (off + 1) + i * (i - 1) // 2
    seen = max(0, i + off)  # rows below -off see nothing
    return seen * (seen + 1) // 2


def _query_bounds(sq: int, sk: int, causal: bool, blocks: int) -> list[int]:
    """`0 = b0 < ... < bn = sq` cutting the rows into `blocks` of about equal cost."""
    total = _pairs_before(sq, sq, sk, causal)
    bounds = [0]
    for j in range(1, blocks):
        lo, hi = bounds[-1] + 1, sq - 1
        target = total * j // blocks
        while lo < hi:  # the first row at which the cost so far reaches the target
            mid = (lo + hi) // 2
            if _pairs_before(mid, sq, sk, causal) >= target:
                hi = mid
            else:
                lo = mid + 1
        if lo < sq and lo > bounds[-1]:
            bounds.append(lo)
    bounds.append(sq)
    return bounds


def _block_piece(
    q_cu: tuple[int, ...],
    kv_cu: tuple[int, ...],
    r: int,
    rows: tuple[int, int],
    heads: tuple[int, int],
    causal: bool,
    cost: int,
) -> Piece:
    sq, sk = q_cu[r + 1] - q_cu[r], kv_cu[r + 1] - kv_cu[r]
    a, b = rows
    keys = min(max(b + sk - sq, 0), sk) if causal else sk
    return Piece(
        r,
        r + 1,
        heads[0],
        heads[1],
        q_cu[r] + a,
        q_cu[r] + b,
        kv_cu[r],
        kv_cu[r] + keys,
        (0, b - a),
        (0, keys),
        cost,
    )


def schedule(
    q_cu: tuple[int, ...],
    kv_cu: tuple[int, ...],
    heads: int,
    causal: bool,
    workers: int,
    min_piece_cost: int = 1,
) -> list[list[Piece]]:
    """Pieces per worker (some lists may be empty), covering every (sequence, head) that has
    queries once; sequences whose queries see no key cost nothing and ride in a pack, where the
    worker writes their out = 0, lse = -inf like any other blind rows. No piece is made smaller
    than `min_piece_cost` by splitting (a batch costing less runs whole on one worker), and with
    one worker nothing is split: its pieces would run one after another anyway."""
    b = len(q_cu) - 1
    costs = [
        heads * visible_pairs(q_cu[r + 1] - q_cu[r], kv_cu[r + 1] - kv_cu[r], causal)
        for r in range(b)
    ]
    total = sum(costs)
    plan: list[list[Piece]] = [[] for _ in range(workers)]
    share = max(total / workers, min_piece_cost, 1)  # a worker's fair share
    # sequences above the grain are split by heads (and query blocks)
    grain = max(share / 2, min_piece_cost) if workers > 1 else math.inf
    pieces: list[Piece] = []
    r = 0
    while r < b:
        if q_cu[r + 1] == q_cu[r]:
            r += 1  # no queries: nothing to write
            continue
        if costs[r] > grain:
            sq, sk = q_cu[r + 1] - q_cu[r], kv_cu[r + 1] - kv_cu[r]
            needed = math.ceil(costs[r] / grain)
            groups = min(heads, needed)
            bounds = _query_bounds(sq, sk, causal, min(sq, math.ceil(needed / groups)))
            for g in range(groups):
                h0, h1 = g * heads // groups, (g + 1) * heads // groups
                for a, e in itertools.pairwise(bounds):
                    cost = (h1 - h0) * (
                        _pairs_before(e, sq, sk, causal) - _pairs_before(a, sq, sk, causal)
                    )
                    pieces.append(_block_piece(q_cu, kv_cu, r, (a, e), (h0, h1), causal, cost))
            r += 1
            continue
        r1, acc = r, 0
        # pack up to a whole share: each kernel call then batches as many sequences as it can
        while r1 < b and costs[r1] <= grain and acc + costs[r1] <= share:
            acc += costs[r1]
            r1 += 1
        pieces.append(_piece(q_cu, kv_cu, r, r1, 0, heads, acc))
        r = r1
    loads = [(0, w) for w in range(workers)]
    for p in sorted(pieces, key=lambda p: (-p.cost, p.r0, p.h0, p.q_lo)):
        load, w = heapq.heappop(loads)
        plan[w].append(p)
        heapq.heappush(loads, (load + p.cost, w))
    for mine in plan:
        mine.sort(key=lambda p: (p.r0, p.h0, p.q_lo))
    return plan
