"""The 8-bit-activation decode kernel (``fuel_matmul_q8``, ``matmul(..., activations="q8")``).

Two oracles. The strong one: the exact product of the kernel's own rounded activations
(``quantize_q8``, itself checked bit for bit against the stated rounding in torch) with the
exact weights unpacked here from the packed bytes, in f64; the kernel must agree to its f32
arithmetic (the ``A`` term of ``native_synth.q8_error_bound``, ~1e-6 relative). The recipe one:
the dequantize-then-matmul f32 reference, within the stated bound (``R + A`` plus the recipe
tolerance), and NOT within the recipe tolerance alone (the kernel really rounds). Every format,
1-4 rows, N not a multiple of the 16-row tile, K a multiple of 32 but not of 128 or 256 (every
partial last group of four blocks), on the native build and on the AVX-VNNI, AVX2 and portable
builds."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from fuel.graph.dtype import DType
from fuel.jit.adopt import verify
from fuel.jit.native_synth import q8_error_bound
from fuel.kernels import RECIPE_TOLERANCE, native
from fuel.circuit.format import REGROUPED
from fuel.kernels.quant_blocks import dequantize, random_blocks, regroup

TOLERANCE = RECIPE_TOLERANCE[DType.F32]
FORMATS = ("q4_0", "q4_1", "q4_1x8", "q5_0", "q5_1", "q8_0", "q8_0x8")
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}
COLS = (32, 96, 160, 192, 224, 512, 576, 1568)
"""K/32 = 1, 3, 5, 6, 7, 16, 18, 49: one block, a partial group alone, and groups of four
followed by 0, 1, 2 and 3 blocks; for q4_1x8 (groups of eight) a short group alone of 1, 3, 5,
6 and 7 blocks, and full groups followed by 0, 2 (SmolLM2's 576) and 1 blocks (q8_0x8 alike)."""


@pytest.fixture(scope="module")
def lib(native_lib):
    return native_lib


def exact_weights(w: torch.Tensor, layout: str, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights d*q + m of packed rows in f64, computed exactly from the bytes (not through the
    f32 dequantizer), and each block's offset magnitude |o| as the kernel's integer path sees it."""
    if layout in REGROUPED:  # the file layout's blocks, moved: the same weights
        return exact_weights(regroup(w, layout, cols, back=True), REGROUPED[layout], cols)
    n, blocks = w.shape[0], cols // 32
    b = w.contiguous().view(torch.uint8).reshape(n, blocks, BLOCK_BYTES[layout]).long()
    half = lambda lo: (b[..., lo] | (b[..., lo + 1] << 8)).to(torch.int16).view(torch.float16).double()  # noqa: E731
    d = half(0)
    if layout == "q8_0":
        q = b[..., 2:34].to(torch.uint8).view(torch.int8).double()
        return (d[..., None] * q).reshape(n, cols), 128 * d.abs()
    qs_at = {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}[layout]
    qs = b[..., qs_at:qs_at + 16]
    u = torch.cat([qs & 15, qs >> 4], dim=-1)
    if layout in ("q5_0", "q5_1"):
        at = 2 if layout == "q5_0" else 4
        qh = b[..., at] | (b[..., at + 1] << 8) | (b[..., at + 2] << 16) | (b[..., at + 3] << 24)
        u = u | (((qh[..., None] >> torch.arange(32)) & 1) << 4)
    if layout in ("q4_1", "q5_1"):
        m = half(2)
        return (d[..., None] * u.double() + m[..., None]).reshape(n, cols), m.abs()
    shift = 8 if layout == "q4_0" else 16
    return (d[..., None] * (u - shift).double()).reshape(n, cols), shift * d.abs()


def stated_rounding(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding the kernel documents, in torch f32: d = amax/127, q = round(x * 127/amax)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse).to(torch.int8).reshape(x.shape)
    return q, (amax / 127.0).squeeze(-1)


def check_against_exact(kernels, layout: str, rows: int, cols: int, n: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    w = random_blocks(layout, n, cols, generator)
    x = torch.randn(rows, cols, generator=generator) * 3
    if cols >= 64:
        x[0, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    got = kernels.matmul(layout, x, w, cols, activations="q8").double()
    q, d = kernels.quantize_q8(x)
    weights, offset = exact_weights(w, layout, cols)
    xhat = (q.double().view(rows, -1, 32) * d.double()[..., None]).view(rows, cols)
    want = xhat @ weights.T
    units = (cols // 32 + 10) * 2.0 ** -24
    allowed = units / (1 - units) * (xhat.abs() @ (weights.abs() + 2 * offset.repeat_interleave(32, -1)).T)
    excess = (got - want).abs() - allowed
    assert bool((excess <= 0).all()), (
        f"{layout} rows={rows} cols={cols}: off the exact integer product by "
        f"{float((got - want).abs().max()):.3e} (allowed {float(allowed.max()):.3e})")


def test_quantize_q8_is_the_stated_rounding(lib):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1568, generator=generator) * torch.rand(4, 1568, generator=generator) * 10
    x[1, :32] = 0.0
    x[2, 40] = 1e-30  # a tiny value in a normal block
    x[3, 64:96] = torch.arange(32) - 15.5  # ties at .5 steps after scaling are exercised below
    q, d = lib.quantize_q8(x)
    want_q, want_d = stated_rounding(x)
    assert torch.equal(q, want_q) and torch.equal(d, want_d)
    assert int(q.abs().max()) <= 127 and bool((d[1, 0] == 0) & (q[1, :32] == 0).all())
    ties = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5] + [0.0] * 26 + [127.0]])  # amax 127: id = 1
    assert lib.quantize_q8(ties)[0][0, :5].tolist() == [0, 2, 2, 0, -2]  # half to even


def test_a_non_finite_activation_makes_its_row_nan(lib):
    w = random_blocks("q4_1", 20, 96, torch.Generator().manual_seed(1))
    x = torch.randn(3, 96)
    x[1, 40] = float("inf")
    x[2, 7] = float("nan")
    out = lib.matmul("q4_1", x, w, 96, activations="q8")
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1:]).all()
    assert torch.isnan(lib.quantize_q8(x)[1][1:]).any()


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("cols", COLS)
def test_the_kernel_is_the_exact_integer_product_of_its_rounded_activations(lib, layout, cols):
    for rows in (1, 2, 3, 4):
        check_against_exact(lib, layout, rows, cols, 37, seed=rows + cols)


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("cols", (224, 1568))
def test_the_kernel_is_within_its_stated_bound_of_the_recipe_and_only_there(lib, layout, cols):
    generator = torch.Generator().manual_seed(cols)
    w = random_blocks(layout, 53, cols, generator)
    reference_w = dequantize(w, layout, cols)
    beyond_tolerance = False
    for rows in (1, 3, 4):
        x = torch.randn(rows, cols, generator=generator)
        got = lib.matmul(layout, x, w, cols, activations="q8")
        want = x @ reference_w.T
        bound = q8_error_bound(layout, cols, x, w)
        check = verify(got, want, TOLERANCE, bound)
        assert check.ok, f"{rows} rows: {check.report}"
        assert check.max_abs_error < 0.5 * check.bound_max  # the worst case is far from typical
        beyond_tolerance |= not verify(got, want, TOLERANCE).ok
    assert beyond_tolerance, "an 8-bit-activation kernel within f32 tolerance does not round"


def test_more_rows_than_a_decode_step_keep_f32_activations(lib):
    """activations="q8" rounds decode rows only; a prefill call is the f32 GEMM path (its bound
    is zero there)."""
    w = random_blocks("q4_0", 40, 224, torch.Generator().manual_seed(2))
    x = torch.randn(native.STREAM_ROWS + 2, 224)
    got = lib.matmul("q4_0", x, w, 224, activations="q8")
    assert torch.equal(got, lib.matmul("q4_0", x, w, 224))
    assert torch.equal(q8_error_bound("q4_0", 224, x, w), torch.zeros(x.shape[0], 40, dtype=torch.float64))


def test_formats_without_a_q8_kernel_are_refused(lib):
    w = random_blocks("q4_k", 4, 256, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="no 8-bit-activation kernel for q4_k"):
        lib.matmul("q4_k", torch.randn(1, 256), w, 256, activations="q8")
    with pytest.raises(ValueError, match="activations must be"):
        lib.matmul("q4_0", torch.randn(1, 32), random_blocks("q4_0", 4, 32, torch.Generator()), 32,
                   activations="q4")


_BUILDS = [pytest.param((), id="portable")]
if platform.machine() == "x86_64":
    _AVX2 = ("-mavx2", "-mfma", "-mf16c")
    _BUILDS += [pytest.param(_AVX2, id="avx2"),
                pytest.param(_AVX2 + ("-mavxvnni",), id="avx-vnni"),
                pytest.param(_AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
                             id="avx512-vnni-no-vbmi")]


@pytest.mark.parametrize("isa", _BUILDS)
def test_every_build_is_the_exact_integer_product(tmp_path, isa):
    """gemv.c built for the paths this machine's native build skips: portable C, AVX2 alone
    (vpmaddubsw; q8_0 by the sign trick), AVX-VNNI (256-bit vpdpbusd, VEX), AVX-512 VNNI without
    VBMI (256-bit vpdpbusd, EVEX). Every variant is built on every machine (its code compiles
    and links, the entry points load); its products are checked where the CPU runs its
    instructions (every variant on the AVX-512 VNNI machines fuel is developed on)."""
    from tests.conftest import build_native_variant

    # Loading binds every entry point (a missing one raises): nothing of the variant runs yet.
    variant = build_native_variant(tmp_path / "variant.so", isa)
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    need = {"-mavxvnni": "avx_vnni", "-mavx512vnni": "avx512_vnni", "-mavx2": "avx2"}
    if any(need[f] not in flags for f in isa if f in need):
        return  # built and loaded; this CPU cannot execute the variant's products
    x = torch.randn(4, 1568, generator=torch.Generator().manual_seed(5)) * 4
    q, d = variant.quantize_q8(x)
    want_q, want_d = stated_rounding(x)
    assert torch.equal(q, want_q) and torch.equal(d, want_d)
    for layout in FORMATS:
        for cols in (96, 160, 192, 224, 1568):
            for rows in (1, 4):
                check_against_exact(variant, layout, rows, cols, 21, seed=cols * rows)


@pytest.mark.parametrize("layout", sorted(REGROUPED))
@pytest.mark.parametrize("cols", (32, 96, 224, 256, 288, 416, 576, 800, 1536))
def test_a_regrouped_layout_computes_what_its_file_layout_computes_from_the_same_blocks(lib, layout, cols):
    """q4_1x8 / q8_0x8 hold q4_1's / q8_0's bytes regrouped (scales apart from quants, eight
    blocks a group): the native regrouping is the reference one both ways; dequantized and with
    f32 activations it is the file layout bit for bit (the same arithmetic on the same blocks);
    with 8-bit activations the same exact integer dots summed in another f32 order, so within
    the reassociation of B + 10 roundings. K/32 = 1 .. 49: short last groups of every size and
    full groups with none."""
    source = REGROUPED[layout]
    generator = torch.Generator().manual_seed(cols)
    file_rows = random_blocks(source, 29, cols, generator)
    grouped = regroup(file_rows, layout, cols)
    assert torch.equal(lib.regroup(source, file_rows, cols), grouped)
    assert torch.equal(lib.regroup(layout, grouped, cols, back=True), file_rows)
    with pytest.raises(ValueError, match="no regrouped layout"):
        lib.regroup("q5_0", random_blocks("q5_0", 2, cols, generator), cols)
    if cols > 32:
        assert not torch.equal(grouped, file_rows)
    assert torch.equal(lib.dequantize(layout, grouped, cols), dequantize(file_rows, source, cols))
    assert torch.equal(dequantize(grouped, layout, cols), dequantize(file_rows, source, cols))
    for rows in (1, 2, 3, 4, 6):
        x = torch.randn(rows, cols, generator=generator)
        assert torch.equal(lib.matmul(layout, x, grouped, cols), lib.matmul(source, x, file_rows, cols))
        if rows <= native.STREAM_ROWS:
            got = lib.matmul(layout, x, grouped, cols, activations="q8").double()
            want = lib.matmul(source, x, file_rows, cols, activations="q8").double()
            q, d = lib.quantize_q8(x)
            weights, offset = exact_weights(file_rows, source, cols)
            xhat = (q.double().view(rows, -1, 32) * d.double()[..., None]).view(rows, cols)
            units = 2 * (cols // 32 + 10) * 2.0 ** -24  # both kernels' roundings
            allowed = units * (xhat.abs() @ (weights.abs() + 2 * offset.repeat_interleave(32, -1)).T)
            assert bool(((got - want).abs() <= allowed).all()), (rows, float((got - want).abs().max()))
