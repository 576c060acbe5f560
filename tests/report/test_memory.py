"""Memory fit: weights once, KV by context and concurrency, 90% of device memory usable."""

from __future__ import annotations

from fuel.circuit.format import BF16
from fuel.report.memory import CONCURRENCIES, USABLE_FRACTION, memory_fit, stored_weight_bytes
from tests.report.builders import dense_circuit


def test_stored_weights_include_the_whole_embedding_table():
    h, q, kv, d, inter, vocab, layers = 64, 4, 2, 16, 128, 256, 2
    c = dense_circuit(layers, h, q, kv, d, inter, vocab)
    per_layer = h * q * d + 2 * h * kv * d + q * d * h + h * 2 * inter + inter * h + 2 * h
    assert stored_weight_bytes(c) == 2 * (layers * per_layer + vocab * h + h + vocab * h)


def test_fit_states_fits_or_the_shortfall():
    fit = memory_fit(weight_bytes=50, kv_bytes_per_token=1, kv_format=BF16, device_bytes=100,
                     contexts=(10,), concurrencies=(1, 4))
    assert fit.usable_bytes == int(100 * USABLE_FRACTION)
    small, big = fit.cells
    assert (small.need_bytes, small.fits, small.shortfall_bytes) == (60, True, 0)
    assert (big.need_bytes, big.fits, big.shortfall_bytes) == (90, True, 0)
    tight = memory_fit(50, 2, BF16, 100, contexts=(10,), concurrencies=(4,))
    cell = tight.cells[0]
    assert (cell.need_bytes, cell.fits, cell.shortfall_bytes) == (130, False, 40)


def test_default_table_covers_powers_of_two_to_128_at_4k_and_32k():
    fit = memory_fit(1, 1, BF16, 10**12)
    assert CONCURRENCIES == (1, 2, 4, 8, 16, 32, 64, 128)
    assert sorted({c.context for c in fit.cells}) == [4096, 32768]
    assert fit.max_concurrency(4096) == 128
