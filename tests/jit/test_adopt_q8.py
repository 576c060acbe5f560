"""Adoption of a kernel that states its own error bound (``SynthesizedKernel.error_bound``): the
native 8-bit-activation decode kernel is verified against the recipe within its bound plus the
recipe tolerance and adopted, every format; a kernel beyond its bound, or with a bound that is not
a bound, is rejected; without a bound the default check stands (and rejects the rounding
kernel)."""

from __future__ import annotations

import pytest
import torch

from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, RuntimeFusedRegistry
from fuel.jit import Synthesized, SynthesizedKernel
from fuel.jit.adopt import Outcome, adopt
from fuel.jit.native_synth import KERNEL_SOURCE_Q8, CpuSynthesizer, q8_error_bound
from fuel.kernels import cpu_table
from fuel.kernels.quant_blocks import packed_row_bytes

from tests.jit.helpers import request_for


def quant_request(layout: str, rows: int, n: int, cols: int):
    graph = Graph()
    x = graph.input("x", (rows, cols), DType.F32)
    w = graph.input("w", (n, packed_row_bytes(layout, cols)), DType.U8)
    node = graph.fused(FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear(layout, cols), x, w)
    return request_for(graph, node)


class BoundSynth:
    """Hands over ``run`` with ``bound`` as its stated error bound; records rejections."""

    name = "bound-fake"

    def __init__(self, run, bound):
        self._run, self._bound = run, bound
        self.rejected: list[str] = []

    def synthesize(self, request):
        return Synthesized("fake:q8")

    def take_kernel(self, entry_point):
        return SynthesizedKernel(entry_point, "k", BackendId.CPU, "fake.q8", self._run, "", 0.0,
                                 False, self._bound)

    def on_rejected(self, entry_point, report):
        self.rejected.append(report)


@pytest.fixture(scope="module")
def lib(native_lib):
    return native_lib


def _adopt(synth, request):
    return adopt(synth, request, BackendId.CPU, table=cpu_table(), registry=RuntimeFusedRegistry(),
                 profile_repeats=3)


@pytest.mark.parametrize("layout", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
@pytest.mark.parametrize("rows, n, cols", [(1, 70, 576), (3, 37, 224)])
def test_the_q8_kernel_is_verified_within_its_bound_and_adopted(lib, tmp_path, layout, rows, n, cols):
    record = _adopt(CpuSynthesizer(cache_dir=tmp_path), quant_request(layout, rows, n, cols))
    assert record.outcome is Outcome.ADOPTED, record.reason
    assert record.kernel_source == KERNEL_SOURCE_Q8
    assert record.error_bound_max is not None and record.error_bound_max > 0
    assert record.max_abs_error is not None and record.max_abs_error < record.error_bound_max
    assert "within its stated bound" in record.reason


def _q8_runner(lib, layout, cols):
    return lambda x, w: lib.matmul(layout, x, w, cols, activations="q8")


def _bound(layout, cols, scale=1.0):
    return lambda inputs, reference: scale * q8_error_bound(layout, cols, inputs[0], inputs[1])


def test_a_kernel_beyond_its_bound_is_rejected(lib):
    layout, cols = "q4_1", 224
    run = _q8_runner(lib, layout, cols)

    def beyond(x, w):  # off by 1.5x its own allowance (plus the recipe tolerance) everywhere
        out = run(x, w)
        return out + (1.5 * q8_error_bound(layout, cols, x, w) + 1e-3).float()

    synth = BoundSynth(beyond, _bound(layout, cols))
    record = _adopt(synth, quant_request(layout, 1, 40, cols))
    assert record.outcome is Outcome.WRONG and record.runtime_id is None
    assert "the kernel's bound" in record.reason and synth.rejected == [record.reason]
    assert record.error_bound_max is not None


def test_a_q4_1_kernel_that_forgets_the_offset_term_is_rejected(lib):
    """A realistic bug: the m_w * d_b * S_b term dropped (q4_1's offset times the block sums)."""
    layout, cols = "q4_1", 576
    run = _q8_runner(lib, layout, cols)

    def no_offset(x, w):
        q, d = lib.quantize_q8(x)
        n, blocks = w.shape[0], cols // 32
        m = w.view(torch.uint8).reshape(n, blocks, 20)[..., 2:4].contiguous().view(torch.float16)
        sums = (q.double().view(-1, blocks, 32).sum(-1) * d.double())              # [M, B]
        return (run(x, w).double() - sums @ m.double().squeeze(-1).T).float()

    record = _adopt(BoundSynth(no_offset, _bound(layout, cols)), quant_request(layout, 1, 64, cols))
    assert record.outcome is Outcome.WRONG, record.reason


def test_the_rounding_kernel_without_a_bound_fails_the_default_check(lib):
    layout, cols = "q8_0", 576
    record = _adopt(BoundSynth(_q8_runner(lib, layout, cols), None),
                    quant_request(layout, 1, 64, cols))
    assert record.outcome is Outcome.WRONG and record.error_bound_max is None
    assert "kernel's bound" not in record.reason


@pytest.mark.parametrize("bad", ["nan", "negative", "raises"])
def test_a_bound_that_is_not_a_bound_rejects_its_kernel(lib, bad):
    layout, cols = "q5_0", 224
    good = _bound(layout, cols)

    def bound(inputs, reference):
        if bad == "raises":
            raise RuntimeError("no bound here")
        value = good(inputs, reference)
        value[0, 0] = float("nan") if bad == "nan" else -1.0
        return value

    synth = BoundSynth(_q8_runner(lib, layout, cols), bound)
    record = _adopt(synth, quant_request(layout, 1, 40, cols))
    assert not record.adopted and synth.rejected
    assert record.outcome is (Outcome.NOT_VERIFIABLE if bad == "raises" else Outcome.WRONG)


def test_an_adopted_rounding_kernel_is_bound_as_stated_bound_precision_not_recipe_tolerance(
        lib, tmp_path):
    """The table says what the kernel guarantees: a kernel verified within its own bound is
    weaker than one within the recipe tolerance, and a bake that requires the latter refuses it."""
    from fuel.kernels import Precision
    from fuel.optimize.variant_bake import meets

    table, registry = cpu_table(), RuntimeFusedRegistry()
    q8 = adopt(CpuSynthesizer(cache_dir=tmp_path), quant_request("q4_1", 1, 70, 576), BackendId.CPU,
               table=table, registry=registry, profile_repeats=3)
    exact = adopt(CpuSynthesizer(cache_dir=tmp_path), quant_request("q4_k", 1, 70, 256),
                  BackendId.CPU, table=table, registry=registry, profile_repeats=3)
    precisions = {}
    for name, record in (("q8", q8), ("f32", exact)):
        assert record.outcome is Outcome.ADOPTED, record.reason
        dtypes = (DType.F32, DType.U8, DType.F32)
        precisions[name] = table.find(record.runtime_id, dtypes, BackendId.CPU).precision
    assert precisions == {"q8": Precision.STATED_BOUND, "f32": Precision.RECIPE_TOLERANCE}
    assert not meets(Precision.STATED_BOUND, Precision.RECIPE_TOLERANCE)
    assert meets(Precision.STATED_BOUND, None)
