"""The buffer planner (SPEC §A9): where each materialized edge of a plan lives in one arena.

Decides: each materialized edge's live range in group positions (from its producer's group to
its last in-scope reader's; an edge that leaves the plan — a declared output, or one read
outside the section — lives to the end; an outside input, from the start), its size in its
stored format at the plan's rows (or wider rows given by the caller, so one arena serves every
smaller step), and its offset: first fit at 256-byte aligned offsets among the buffers whose
live ranges overlap.

Invariants:
- Two slots whose live ranges intersect never overlap in bytes.
- Every offset is a multiple of ``ALIGNMENT``; ``arena_bytes`` is the end of the last slot,
  rounded up to ``ALIGNMENT``; ``materialized_bytes`` is the sum of the slots' sizes.
- Slots are assigned in (start, edge index) order, so the layout is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuel.circuit.fuser import EdgeState, FusionPlan
from fuel.circuit.ir import Circuit

ALIGNMENT = 256


@dataclass(frozen=True, slots=True)
class BufferSlot:
    edge: int
    offset: int
    bytes: int
    first: int  # group position where the buffer becomes live
    last: int  # group position after which it is dead (inclusive)


@dataclass(frozen=True, slots=True)
class BufferPlan:
    slots: tuple[BufferSlot, ...]  # in edge order
    arena_bytes: int
    materialized_bytes: int


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def plan_buffers(circuit: Circuit, plan: FusionPlan, rows: int | None = None) -> BufferPlan:
    """Lay out ``plan``'s materialized edges at ``rows`` rows (default: the plan's)."""
    rows = plan.rows if rows is None else rows
    owner = plan.owner_of()
    end = max(len(plan.groups) - 1, 0)
    wanted: list[tuple[int, int, int, int]] = []  # (first, edge, last, bytes)
    for e, edge in enumerate(circuit.edges):
        if plan.edge_states[e] != EdgeState.MATERIALIZED:
            continue
        producer = owner.get(edge.producer) if edge.producer is not None else None
        first = 0 if producer is None else producer
        readers = [owner[c] for c in edge.consumers if c in owner]
        leaves = edge.is_output or len(readers) < len(edge.consumers) or not edge.consumers
        last = end if leaves else max(readers, default=first)
        size = plan.edge_formats[e].bytes(edge.rows_at(rows, circuit.dims), edge.dim_value)
        wanted.append((first, e, max(last, first), size))
    wanted.sort()
    placed: list[BufferSlot] = []
    live: list[BufferSlot] = []  # slots that may still overlap: starts only grow
    for first, e, last, size in wanted:
        live = [s for s in live if s.last >= first]
        busy = sorted((s.offset, s.offset + s.bytes) for s in live if s.bytes > 0)
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, _align(hi))
        slot = BufferSlot(e, offset, size, first, last)
        placed.append(slot)
        live.append(slot)
    placed.sort(key=lambda s: s.edge)
    arena = _align(max((s.offset + s.bytes for s in placed), default=0))
    return BufferPlan(tuple(placed), arena, sum(s.bytes for s in placed))
