"""Paged KV cache: slot mapping, all-or-nothing appends, rollback, no leaked or shared blocks,
and the K/V storage written and read through the block tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fuel.runtime.kv_cache import (
    PAD_BLOCK,
    BlockTables,
    KvLayout,
    OutOfKvBlocks,
    PagedKvCache,
    SequenceTooLong,
    UnknownSequence,
)


def test_slots_follow_the_block_table():
    tables = BlockTables(num_blocks=4, block_size=4)
    tables.add("a")
    tables.add("b")
    assert tables.append("a", 6) == [0, 1, 2, 3, 4, 5]  # blocks 0, 1
    assert tables.append("b", 3) == [8, 9, 10]  # block 2
    assert tables.append("a", 3) == [6, 7, 12]  # fills block 1, then takes block 3
    assert tables.blocks("a") == (0, 1, 3) and tables.length("a") == 9
    assert tables.slot("a", 8) == 12


def test_block_table_and_lengths_are_padded_uint32():
    tables = BlockTables(num_blocks=8, block_size=2)
    for name, tokens in (("x", 5), ("y", 1)):
        tables.add(name)
        tables.append(name, tokens)
    table = tables.block_table(["x", "y"])
    assert table.dtype == np.uint32 and table.tolist() == [[0, 1, 2], [3, PAD_BLOCK, PAD_BLOCK]]
    lengths = tables.context_lengths(["y", "x"])
    assert lengths.dtype == np.uint32 and lengths.tolist() == [1, 5]
    assert tables.block_table(["y"], width=4).tolist() == [[3, 0, 0, 0]]


def test_a_reused_table_buffer_holds_only_the_latest_tables():
    # The engine writes each step's tables into the buffer of the step before.
    tables = BlockTables(num_blocks=8, block_size=2)
    for name, tokens in (("x", 5), ("y", 1)):
        tables.add(name)
        tables.append(name, tokens)
    table, lengths = np.full((1, 3), 7, dtype=np.uint32), np.full(1, 7, dtype=np.uint32)
    assert tables.block_table_into(["x"], table) is table and table.tolist() == [[0, 1, 2]]
    assert tables.block_table_into(["y"], table).tolist() == [[3, PAD_BLOCK, PAD_BLOCK]]
    assert tables.context_lengths_into(["x"], lengths).tolist() == [5]
    with pytest.raises(ValueError, match="does not fit width 2"):
        tables.block_table_into(["x"], np.empty((1, 2), dtype=np.uint32))


def test_rollback_frees_whole_blocks_past_the_new_end():
    tables = BlockTables(num_blocks=4, block_size=4)
    tables.add("s")
    tables.append("s", 10)  # blocks 0, 1, 2
    tables.rollback("s", 5)  # keeps ceil(5/4) = 2 blocks
    assert tables.blocks("s") == (0, 1) and tables.length("s") == 5 and tables.free_blocks == 2
    # The rolled-back rows are rewritten in place: the next slot is position 5's.
    assert tables.append("s", 1) == [5]


def test_freed_blocks_are_reused_lowest_first():
    tables = BlockTables(num_blocks=4, block_size=2)
    for name in "abc":
        tables.add(name)
        tables.append(name, 2)
    tables.free("b")
    tables.free("a")
    tables.add("d")
    tables.append("d", 4)
    assert tables.blocks("d") == (0, 1)
    assert "a" not in tables and tables.sequences() == ["c", "d"]


def test_out_of_blocks_changes_nothing():
    tables = BlockTables(num_blocks=3, block_size=4)
    tables.add("a")
    tables.add("b")
    tables.append("a", 8)
    with pytest.raises(OutOfKvBlocks, match="appending 5 tokens to sequence 'b' needs 2 more blocks, 1 are free") as caught:
        tables.append("b", 5)
    assert (caught.value.needed, caught.value.free) == (2, 1)
    assert tables.length("b") == 0 and tables.blocks("b") == () and tables.free_blocks == 1
    assert not tables.can_append("b", 5) and tables.can_append("b", 4)


def test_prompt_longer_than_the_cache_is_a_clear_error():
    tables = BlockTables(num_blocks=2, block_size=16)
    tables.add(0)
    with pytest.raises(SequenceTooLong, match="would hold 40 tokens, but the cache holds at most 32 tokens"):
        tables.append(0, 40)
    assert tables.length(0) == 0


def test_unknown_sequence_and_bad_lengths_are_refused():
    tables = BlockTables(num_blocks=2, block_size=2)
    with pytest.raises(UnknownSequence, match="no sequence 'ghost'"):
        tables.append("ghost", 1)
    tables.add("s")
    tables.append("s", 2)
    with pytest.raises(ValueError, match="back to 3"):
        tables.rollback("s", 3)
    with pytest.raises(IndexError):
        tables.slot("s", 2)


class BlockTablesMachine(RuleBasedStateMachine):
    """Random add/append/rollback/free sequences never leak, share or over-allocate blocks."""

    def __init__(self):
        super().__init__()
        self.tables = BlockTables(num_blocks=6, block_size=3)
        self.next_id = 0
        self.lengths: dict[int, int] = {}

    @rule()
    def add(self):
        self.tables.add(self.next_id)
        self.lengths[self.next_id] = 0
        self.next_id += 1

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), tokens=st.integers(0, 10))
    def append(self, data, tokens):
        sequence = data.draw(st.sampled_from(sorted(self.lengths)))
        # The model's own account: what the append needs, and what is free.
        size = self.tables.block_size
        blocks_for = lambda length: -(-length // size)  # noqa: E731
        free = self.tables.num_blocks - sum(blocks_for(n) for n in self.lengths.values())
        new_length = self.lengths[sequence] + tokens
        needed = blocks_for(new_length) - blocks_for(self.lengths[sequence])
        too_long = new_length > self.tables.num_blocks * size
        try:
            slots = self.tables.append(sequence, tokens)
        except SequenceTooLong:
            assert too_long, "refused as too long, yet it fits the cache"
            return
        except OutOfKvBlocks:
            assert not too_long and needed > free, f"refused with {free} free blocks for {needed}"
            return
        assert not too_long and needed <= free, "an append the cache cannot hold succeeded"
        assert len(slots) == tokens
        self.lengths[sequence] += tokens

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def rollback(self, data):
        sequence = data.draw(st.sampled_from(sorted(self.lengths)))
        length = data.draw(st.integers(0, self.lengths[sequence]))
        self.tables.rollback(sequence, length)
        self.lengths[sequence] = length

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data):
        sequence = data.draw(st.sampled_from(sorted(self.lengths)))
        self.tables.free(sequence)
        del self.lengths[sequence]

    @invariant()
    def every_block_is_free_or_owned_by_exactly_one_sequence(self):
        owned = [block for sequence in self.lengths for block in self.tables.blocks(sequence)]
        assert len(owned) == len(set(owned))
        assert sorted(owned + list(self.tables._free)) == list(range(self.tables.num_blocks))

    @invariant()
    def each_sequence_owns_exactly_the_blocks_its_length_needs(self):
        for sequence, length in self.lengths.items():
            assert self.tables.length(sequence) == length
            assert len(self.tables.blocks(sequence)) == -(-length // self.tables.block_size)

    @invariant()
    def live_slots_are_distinct_across_sequences(self):
        slots = [s for sequence, length in self.lengths.items() for s in self.tables.slots(sequence, 0, length)]
        assert len(slots) == len(set(slots))


TestBlockTablesMachine = BlockTablesMachine.TestCase
TestBlockTablesMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_layout_from_smollm2_config_states_the_tensor_shape():
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "head_dim": 64}
    layout = KvLayout.from_config(config, num_blocks=128, block_size=16)
    assert layout.block_shape == (128, 3, 16, 64)
    assert layout.bytes(element_size=2) == 2 * 30 * 128 * 3 * 16 * 64 * 2


def test_written_rows_are_read_back_in_sequence_order_after_rollback():
    layout = KvLayout(layers=2, kv_heads=2, head_dim=3, block_size=4, num_blocks=5)
    cache = PagedKvCache(layout, dtype=torch.float32)
    assert cache.keys[0].shape == (5, 2, 4, 3)
    generator = torch.Generator().manual_seed(0)
    expected_k: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    expected_v: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for name in ("a", "b"):
        cache.tables.add(name)
    for name, rows in (("a", 3), ("b", 6), ("a", 4), ("b", 1)):
        k = torch.randn(rows, 2, 3, generator=generator)
        v = torch.randn(rows, 2, 3, generator=generator)
        cache.write(1, cache.tables.append(name, rows), k, v)
        expected_k[name].append(k)
        expected_v[name].append(v)
    # Reject the last two rows of "a" and write two different ones in their place.
    cache.tables.rollback("a", 5)
    k = torch.randn(2, 2, 3, generator=generator)
    v = torch.randn(2, 2, 3, generator=generator)
    cache.write(1, cache.tables.append("a", 2), k, v)
    keys_a = torch.cat(expected_k["a"])[:5]
    values_a = torch.cat(expected_v["a"])[:5]
    got_k, got_v = cache.gather(1, "a")
    assert got_k.shape == (2, 7, 3)
    assert torch.equal(got_k, torch.cat([keys_a, k]).transpose(0, 1))
    assert torch.equal(got_v, torch.cat([values_a, v]).transpose(0, 1))
    got_k, _ = cache.gather(1, "b")
    assert torch.equal(got_k, torch.cat(expected_k["b"]).transpose(0, 1))
    assert torch.count_nonzero(cache.keys[0]) == 0  # layer 0 untouched


def test_bf16_cache_stores_bf16():
    cache = PagedKvCache(KvLayout(1, 1, 2, 2, 2), dtype=torch.bfloat16)
    cache.tables.add(0)
    cache.write(0, cache.tables.append(0, 1), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    assert cache.keys[0].dtype == torch.bfloat16 and float(cache.keys[0].sum()) == 2.0


def test_a_kv_cache_is_zero_and_only_its_written_pages_become_resident():
    """The engine's caches come from the kernel's zeroed pages (``engine.zeroed_pages``): all
    zeros, writable, and a cache sized for a long context costs memory only where a run writes
    (``torch.zeros`` wrote, and made resident, every byte before the first token)."""
    import resource

    import torch

    from fuel.runtime.engine import zeroed_pages

    def resident_mb() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize() / 2**20

    before = resident_mb()
    caches = [zeroed_pages(torch, (512, 16, 3, 64), torch.bfloat16) for _ in range(40)]  # 126 MB
    assert resident_mb() - before < 16
    assert all(cache.dtype == torch.bfloat16 and not cache.any() for cache in caches[:2])
    caches[0][3, 5] = 1.5  # a written row reads back; its neighbours stay zero
    assert caches[0][3, 5].eq(1.5).all() and caches[0].sum().item() == 1.5 * 3 * 64
