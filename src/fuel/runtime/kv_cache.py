"""The paged KV cache: block bookkeeping, and the per-layer K/V tensors it indexes.

Keys and values of every cached token live in fixed-size blocks of ``block_size`` token slots.
A sequence owns a list of physical blocks (its block table); token ``t`` of the sequence sits in
block ``table[t // block_size]`` at offset ``t % block_size``, i.e. at the physical *slot*
``table[t // block_size] * block_size + t % block_size``.

:class:`BlockTables` is the bookkeeping alone (pure Python, no tensors), so it is easy to test;
:class:`PagedKvCache` pairs it with the storage, per layer one K and one V tensor shaped
``[num_blocks, kv_heads, block_size, head_dim]`` (block-major, so one block's keys for one head
are contiguous — the layout a paged-attention kernel reads with the block table).

Invariants (checked by the property tests):

- Every physical block is either free or owned by exactly one sequence; never both, never two.
- A sequence of length ``L`` owns exactly ``ceil(L / block_size)`` blocks.
- An operation that fails (out of blocks, unknown sequence, bad length) changes nothing.
- Allocation takes the lowest-numbered free block, so the same calls give the same tables in
  any process.

Block tables and context lengths are handed out as ``uint32`` (``paged_attn``'s operand dtypes);
a table shorter than the widest one in a batch is padded with :data:`PAD_BLOCK`.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fuel.errors import FuelError

if TYPE_CHECKING:
    import torch

__all__ = [
    "PAD_BLOCK",
    "BlockTables",
    "KvCacheError",
    "KvLayout",
    "OutOfKvBlocks",
    "PagedKvCache",
    "SequenceTooLong",
    "UnknownSequence",
]

PAD_BLOCK = 0
"""Filler for unused block-table entries; never read, because context lengths bound every read."""


class KvCacheError(FuelError):
    """Base of the KV cache's errors."""


class OutOfKvBlocks(KvCacheError):
    """Appending ``tokens`` to ``sequence`` needs more free blocks than the cache has now."""

    def __init__(self, sequence: Hashable, tokens: int, needed: int, free: int):
        self.sequence = sequence
        self.tokens = tokens
        self.needed = needed
        self.free = free
        super().__init__(
            f"KV cache: appending {tokens} tokens to sequence {sequence!r} needs {needed} more "
            f"blocks, {free} are free"
        )


class SequenceTooLong(KvCacheError):
    """A sequence longer than the whole cache could ever hold (a prompt longer than the cache)."""

    def __init__(self, sequence: Hashable, length: int, capacity: int):
        self.sequence = sequence
        self.length = length
        self.capacity = capacity
        super().__init__(
            f"KV cache: sequence {sequence!r} would hold {length} tokens, but the cache holds at "
            f"most {capacity} tokens; use a shorter prompt, fewer new tokens, or a larger cache"
        )


class UnknownSequence(KvCacheError):
    def __init__(self, sequence: Hashable):
        self.sequence = sequence
        super().__init__(f"KV cache: no sequence {sequence!r}")


@dataclass(slots=True)
class _Sequence:
    blocks: list[int]
    length: int


class BlockTables:
    """Which physical blocks each sequence owns, and how many tokens it holds."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest block id first
        self._sequences: dict[Hashable, _Sequence] = {}

    # -- queries ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Tokens the whole cache holds."""
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def sequences(self) -> list[Hashable]:
        """Live sequence ids, in the order they were added."""
        return list(self._sequences)

    def __contains__(self, sequence: Hashable) -> bool:
        return sequence in self._sequences

    def length(self, sequence: Hashable) -> int:
        return self._get(sequence).length

    def blocks(self, sequence: Hashable) -> tuple[int, ...]:
        return tuple(self._get(sequence).blocks)

    def blocks_needed(self, sequence: Hashable, tokens: int) -> int:
        """Blocks that appending ``tokens`` to ``sequence`` would take from the free list."""
        state = self._get(sequence)
        return self._blocks_for(state.length + tokens) - len(state.blocks)

    def can_append(self, sequence: Hashable, tokens: int) -> bool:
        """Whether :meth:`append` would succeed now (a scheduler's admission question)."""
        state = self._get(sequence)
        return state.length + tokens <= self.capacity and self.blocks_needed(sequence, tokens) <= len(self._free)

    def slot(self, sequence: Hashable, position: int) -> int:
        """The physical slot of token ``position`` (< length) of ``sequence``."""
        state = self._get(sequence)
        if not 0 <= position < state.length:
            raise IndexError(f"position {position} outside sequence {sequence!r} of length {state.length}")
        return state.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, sequence: Hashable, start: int, stop: int) -> list[int]:
        """Physical slots of positions ``start..stop-1``."""
        return [self.slot(sequence, position) for position in range(start, stop)]

    def block_table(self, sequences: Sequence[Hashable], width: int | None = None) -> np.ndarray:
        """``uint32 [len(sequences), width]``: each row a sequence's blocks, padded with
        :data:`PAD_BLOCK`. ``width`` defaults to the longest table."""
        tables = [self._get(sequence).blocks for sequence in sequences]
        width = max((len(table) for table in tables), default=0) if width is None else width
        return self.block_table_into(sequences, np.empty((len(tables), width), dtype=np.uint32))

    def block_table_into(self, sequences: Sequence[Hashable], out: np.ndarray) -> np.ndarray:
        """:meth:`block_table` written into ``out`` (``uint32 [len(sequences), width]``, e.g. a
        step's feed buffer reused from the last step), which it returns."""
        width = out.shape[1]
        out.fill(PAD_BLOCK)
        for row, sequence in enumerate(sequences):
            table = self._get(sequence).blocks
            if len(table) > width:
                raise ValueError(f"block table of {len(table)} blocks does not fit width {width}")
            out[row, : len(table)] = table
        return out

    def context_lengths(self, sequences: Sequence[Hashable]) -> np.ndarray:
        """``uint32 [len(sequences)]``: tokens each sequence holds."""
        return self.context_lengths_into(sequences, np.empty(len(sequences), dtype=np.uint32))

    def context_lengths_into(self, sequences: Sequence[Hashable], out: np.ndarray) -> np.ndarray:
        """:meth:`context_lengths` written into ``out``, which it returns."""
        for row, sequence in enumerate(sequences):
            out[row] = self._get(sequence).length
        return out

    # -- updates ---------------------------------------------------------------------------

    def add(self, sequence: Hashable) -> None:
        """Start an empty sequence."""
        if sequence in self._sequences:
            raise KvCacheError(f"KV cache: sequence {sequence!r} already exists")
        self._sequences[sequence] = _Sequence([], 0)

    def append(self, sequence: Hashable, tokens: int) -> list[int]:
        """Make room for ``tokens`` new tokens at the end of ``sequence``; return their physical
        slots in order (the step's slot mapping for this sequence). All or nothing."""
        if tokens < 0:
            raise ValueError(f"cannot append {tokens} tokens")
        state = self._get(sequence)
        new_length = state.length + tokens
        if new_length > self.capacity:
            raise SequenceTooLong(sequence, new_length, self.capacity)
        needed = self._blocks_for(new_length) - len(state.blocks)
        if needed > len(self._free):
            raise OutOfKvBlocks(sequence, tokens, needed, len(self._free))
        state.blocks.extend(heapq.heappop(self._free) for _ in range(needed))
        start, state.length = state.length, new_length
        return self.slots(sequence, start, new_length)

    def rollback(self, sequence: Hashable, length: int) -> None:
        """Truncate ``sequence`` to its first ``length`` tokens, returning whole blocks past the
        new end to the free list (speculative decoding's rollback of rejected rows)."""
        state = self._get(sequence)
        if not 0 <= length <= state.length:
            raise ValueError(f"cannot roll sequence {sequence!r} of length {state.length} back to {length}")
        keep = self._blocks_for(length)
        for block in state.blocks[keep:]:
            heapq.heappush(self._free, block)
        del state.blocks[keep:]
        state.length = length

    def free(self, sequence: Hashable) -> None:
        """End ``sequence``; all its blocks return to the free list."""
        self.rollback(sequence, 0)
        del self._sequences[sequence]

    # -- internals -------------------------------------------------------------------------

    def _get(self, sequence: Hashable) -> _Sequence:
        try:
            return self._sequences[sequence]
        except KeyError:
            raise UnknownSequence(sequence) from None

    def _blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Shape of the cache tensors: ``layers`` × (K, V) each ``[num_blocks, kv_heads, block_size, head_dim]``."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, num_blocks: int, block_size: int = 16) -> KvLayout:
        """The layout for a Hugging Face llama-style ``config.json``."""
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return cls(
            layers=int(config["num_hidden_layers"]),
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            block_size=block_size,
            num_blocks=num_blocks,
        )

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.kv_heads, self.block_size, self.head_dim)

    def bytes(self, element_size: int) -> int:
        """Bytes of all K and V tensors at ``element_size`` bytes per element."""
        return 2 * self.layers * self.num_blocks * self.kv_heads * self.block_size * self.head_dim * element_size


class PagedKvCache:
    """Block bookkeeping plus per-layer K/V storage.

    ``keys[layer]`` and ``values[layer]`` are ``[num_blocks, kv_heads, block_size, head_dim]``
    tensors in ``dtype`` (float32 or bfloat16), zero-initialised.
    """

    def __init__(self, layout: KvLayout, *, dtype: torch.dtype | None = None, device: str = "cpu"):
        import torch

        self.layout = layout
        self.dtype = dtype or torch.float32
        self.tables = BlockTables(layout.num_blocks, layout.block_size)
        self.keys = [torch.zeros(layout.block_shape, dtype=self.dtype, device=device) for _ in range(layout.layers)]
        self.values = [torch.zeros(layout.block_shape, dtype=self.dtype, device=device) for _ in range(layout.layers)]

    def write(self, layer: int, slots: Sequence[int] | torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new rows: ``keys``/``values`` are ``[rows, kv_heads, head_dim]``, row ``i`` goes
        to physical slot ``slots[i]`` (from :meth:`BlockTables.append`)."""
        import torch

        slots = torch.as_tensor(slots, dtype=torch.long, device=keys.device)
        blocks = torch.div(slots, self.layout.block_size, rounding_mode="floor")
        offsets = slots % self.layout.block_size
        # Advanced indexing on dims 0 and 2 puts the row dim first: [rows, kv_heads, head_dim].
        self.keys[layer][blocks, :, offsets, :] = keys.to(self.dtype)
        self.values[layer][blocks, :, offsets, :] = values.to(self.dtype)

    def gather(self, layer: int, sequence: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's cached keys and values, contiguous: each ``[kv_heads, length, head_dim]``
        (for reference attention and tests)."""
        import torch

        length = self.tables.length(sequence)
        slots = torch.tensor(self.tables.slots(sequence, 0, length), dtype=torch.long)
        blocks = torch.div(slots, self.layout.block_size, rounding_mode="floor")
        offsets = slots % self.layout.block_size
        keys = self.keys[layer][blocks, :, offsets, :].transpose(0, 1)
        values = self.values[layer][blocks, :, offsets, :].transpose(0, 1)
        return keys, values
