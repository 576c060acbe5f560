"""The native CPU matmul kernels (``fuel.kernels.native``): every format equals the
dequantize-then-matmul reference (the gguf package's dequantizer) within the JIT's f32 bound, on
the streaming (decode) path and the tiled GEMM (prefill) path, on random blocks and on SmolLM2's
own rows (no GGUF here stores K-quants: its weights are re-quantized to q4_k/q5_k/q6_k); the
library shares torch's OpenMP runtime (one thread pool); a missing compiler is a reason, not a
crash; and the CPU synthesizer answers quantized matmuls with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fuel.graph.dtype import DType
from fuel.graph.ir import Graph
from fuel.graph.registry import FusedOpParams, FusedOps
from fuel.jit.adopt import verify
from fuel.jit.protocol import Declined, Synthesized
from fuel.kernels import RECIPE_TOLERANCE, native
from fuel.kernels.quant_blocks import dequantize, packed_row_bytes, random_blocks

TOLERANCE = RECIPE_TOLERANCE[DType.F32]
LAYOUTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16", "bf16", "int8_channel")
K_LAYOUTS = ("q4_k", "q5_k", "q6_k")
"""The K-quants: 256-weight super-blocks, so rows of 256 and 512 columns."""


@pytest.fixture(scope="module")
def lib(native_lib):
    return native_lib


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_every_format_equals_the_dequantized_reference(lib, layout, rows):
    generator = torch.Generator().manual_seed(rows)
    # 70 features: not a multiple of the 16-row scheduling tile nor of the 4-row dense block.
    w = random_blocks(layout, 70, 224, generator)
    x = torch.randn(rows, 224, generator=generator)
    want = x @ dequantize(w, layout, 224).T
    check = verify(lib.matmul(layout, x, w, 224), want, TOLERANCE)
    assert check.ok, check.report


@pytest.mark.parametrize("layout", K_LAYOUTS)
@pytest.mark.parametrize("cols", [256, 512])
@pytest.mark.parametrize("rows", [1, 3, 4, 37])
def test_every_k_quant_equals_the_dequantized_reference(lib, layout, cols, rows):
    """Rows 1, 3 and 4 stream the super-blocks (each sub-block decoded once for every row); 37
    dequantizes tiles for torch's GEMM. 70 features: not a multiple of 16."""
    generator = torch.Generator().manual_seed(cols + rows)
    w = random_blocks(layout, 70, cols, generator)
    x = torch.randn(rows, cols, generator=generator)
    want = x @ dequantize(w, layout, cols).T
    check = verify(lib.matmul(layout, x, w, cols), want, TOLERANCE)
    assert check.ok, check.report


@pytest.mark.parametrize("layout", K_LAYOUTS)
def test_a_long_k_quant_stream_takes_its_rows_four_at_a_time(lib, layout):
    """fuel_matmul itself streams any M (in passes of up to four rows): 7 = 4 + 3."""
    generator = torch.Generator().manual_seed(7)
    w = random_blocks(layout, 21, 768, generator)
    x = torch.randn(7, 768, generator=generator)
    out = torch.empty(7, 21)
    status = lib._lib.fuel_matmul(native.FORMAT_CODES[layout], x.data_ptr(), w.data_ptr(),
                                  out.data_ptr(), 7, 21, 768, w.shape[1], 1)
    check = verify(out, x @ dequantize(w, layout, 768).T, TOLERANCE)
    assert status == 0 and check.ok, check.report


@pytest.mark.parametrize("layout", K_LAYOUTS)
def test_k_quant_tiles_dequantize_exactly(lib, layout):
    """The GEMM path's tiles are the reference's values bit for bit (every sub-block, every
    scale packing: 8 super-blocks per row, 5 rows)."""
    w = random_blocks(layout, 5, 2048, torch.Generator().manual_seed(11))
    tile = torch.empty(5, 2048)
    status = lib._lib.fuel_dequantize(native.FORMAT_CODES[layout], w.data_ptr(), tile.data_ptr(),
                                      5, 2048, w.shape[1], 1)
    assert status == 0 and torch.equal(tile, dequantize(w, layout, 2048))


@pytest.mark.parametrize("dtype, name", [(torch.float32, "f32"), (torch.float16, "f16"),
                                         (torch.bfloat16, "bf16")])
def test_dense_weights_multiply_as_they_are(lib, dtype, name):
    generator = torch.Generator().manual_seed(5)
    w = (torch.randn(45, 100, generator=generator) * 0.1).to(dtype)  # 100: not a multiple of 8
    x = torch.randn(2, 100, generator=generator)
    check = verify(lib.matmul(name, x, w, 100), x @ w.float().T, TOLERANCE)
    assert check.ok, check.report


def test_a_width_that_splits_a_block_is_refused(lib):
    w = torch.zeros(4, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match="q4_0 with 40 columns"):
        lib.matmul("q4_0", torch.zeros(1, 40), w, 40)
    w = torch.zeros(4, 144, dtype=torch.uint8)  # a K-quant super-block holds 256, not 32
    with pytest.raises(ValueError, match="q4_k with 288 columns"):
        lib.matmul("q4_k", torch.zeros(1, 288), w, 288)


def test_the_smollm2_rows_match_the_reference(lib):
    from gguf import GGUFReader

    from fuel.runtime.weights import default_model_path

    tensors = {t.name: t for t in GGUFReader(default_model_path()).tensors}
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(4))
    for name, layout in (("blk.0.ffn_gate.weight", "q4_1"), ("token_embd.weight", "q8_0")):
        w = torch.from_numpy(tensors[name].data[:700].copy())
        check = verify(lib.matmul(layout, x, w, 576), x @ dequantize(w, layout, 576).T, TOLERANCE)
        assert check.ok, f"{name}: {check.report}"


@pytest.mark.parametrize("layout", K_LAYOUTS)
def test_k_quants_of_smollm2_weights_match_the_reference(lib, layout):
    """No GGUF here stores K-quants, so SmolLM2's own ffn_down rows (K = 1536) are quantized to
    each K-quant: a trained model's value distribution (outliers included) through the kernels."""
    from gguf import GGUFReader

    from fuel.runtime.weights import default_model_path

    tensor = {t.name: t for t in GGUFReader(default_model_path()).tensors}["blk.0.ffn_down.weight"]
    values = dequantize(torch.from_numpy(tensor.data[:300].copy()), "q4_1", 1536)  # 300 rows
    w = torch.from_numpy(_pack_k_quant(values.numpy(), layout))
    reference = dequantize(w, layout, 1536)
    # the packing is right: the reference dequantizer gives the weights back to quantization error
    assert float((reference - values).pow(2).mean().sqrt()) < 0.1 * float(values.std())
    for rows in (1, 3, 37):
        x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
        check = verify(lib.matmul(layout, x, w, 1536), x @ reference.T, TOLERANCE)
        assert check.ok, f"{rows} rows: {check.report}"


_ISAS = [pytest.param((), id="portable")]
if __import__("platform").machine() == "x86_64":  # the AVX2 flags exist on x86-64 only
    _ISAS.append(pytest.param(("-mavx2", "-mfma", "-mf16c"), id="avx2"))


@pytest.mark.parametrize("isa", _ISAS)
def test_the_portable_and_avx2_builds_equal_the_reference(tmp_path, isa):
    """gemv.c without ``-march=native`` takes the paths this machine's native build skips: the
    portable C (baseline x86-64: no AVX2, no F16C) and the AVX2 intrinsics (a CPU without
    AVX-512): every format, streamed and tiled."""
    from tests.conftest import build_native_variant

    portable = build_native_variant(tmp_path / "portable.so", isa)
    generator = torch.Generator().manual_seed(9)
    for layout in LAYOUTS + K_LAYOUTS:
        cols = 512 if layout in K_LAYOUTS else 224
        w = random_blocks(layout, 37, cols, generator)
        reference = dequantize(w, layout, cols)
        for rows in (1, 3, 6):  # 6 > STREAM_ROWS: the dequantized tiles
            x = torch.randn(rows, cols, generator=generator)
            check = verify(portable.matmul(layout, x, w, cols), x @ reference.T, TOLERANCE)
            assert check.ok, f"{layout}, {rows} rows: {check.report}"
    # dense rows of each float format at a width with every tail (100 = 64 + 32 + 4): one row
    # streamed at a time, the build's widest vector, then the scalar columns
    for dtype, name in ((torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16")):
        w = (torch.randn(45, 100, generator=generator) * 0.1).to(dtype)
        for rows in (1, 3):
            x = torch.randn(rows, 100, generator=generator)
            check = verify(portable.matmul(name, x, w, 100), x @ w.float().T, TOLERANCE)
            assert check.ok, f"{name}, {rows} rows: {check.report}"


@pytest.mark.parametrize("isa", _ISAS)
def test_the_dense_gemm_of_every_build_equals_the_f64_product_or_declines(tmp_path, isa):
    """The prompt-chunk GEMM (``fuel_gemm_dense``) of each build: where it has one (AVX-512, or
    AVX2 with F16C), f32/f16/bf16 weights at edge shapes (rows, weight rows and columns not
    multiples of its tiles or vector width); the portable build has none and says so (None,
    the caller's fallback), never a wrong product. Neither has the prompt-chunk attention
    (AVX-512 only): it declines."""
    from tests.conftest import build_native_variant

    built = build_native_variant(tmp_path / "gemm.so", isa)
    _check_dense_gemm(built, expect_kernel=bool(isa))
    q, cache = torch.randn(1, 4, 8, 64), torch.randn(4, 16, 2, 64)  # no AVX-512: no flash
    assert built.prefill_attn(q, cache, cache, torch.arange(4)[None], torch.tensor([8]), 0.2) is None


def test_the_dense_gemm_equals_the_f64_product_at_edge_shapes(lib):
    _check_dense_gemm(lib, expect_kernel=True)


def _check_dense_gemm(lib, expect_kernel: bool):
    generator = torch.Generator().manual_seed(5)
    for dtype, name in ((torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16")):
        for rows, features, cols in ((5, 7, 33), (67, 13, 48), (130, 70, 224), (1, 6, 16)):
            w = torch.randn(features, cols, generator=generator).to(dtype)
            x = torch.randn(rows, cols, generator=generator)
            for threads in (1, 2):
                got = lib.gemm(name, x, w, cols, threads=threads)
                if not expect_kernel:
                    assert got is None
                    continue
                want = (x.double() @ w.double().T).float()
                check = verify(got, want, TOLERANCE)
                assert check.ok, f"{name} {rows}x{cols} @ {features}x{cols}: {check.report}"
    assert lib.gemm("q4_1", torch.randn(5, 32), torch.zeros(3, 20, dtype=torch.uint8), 32) is None


def _pack_k_quant(values, layout):
    """Packed rows of f32 ``[rows, cols]`` values as q4_k/q5_k/q6_k super-blocks (numpy): a plain
    round-to-nearest quantizer, scales rounded up (no search for the best scales, as llama.cpp
    does), enough to give the kernels a trained model's value distribution. The gguf package has
    no K-quant quantizer; its dequantizer judges this one's packing."""
    import numpy as np

    rows, cols = values.shape
    blocks = values.astype(np.float32).reshape(-1, 8, 32) if layout != "q6_k" else \
        values.astype(np.float32).reshape(-1, 16, 16)
    n = blocks.shape[0]

    def f16(a):
        return a.astype(np.float16)

    if layout == "q6_k":
        group_scale = np.abs(blocks).max(axis=-1) / 31.0                       # [n, 16]
        d = f16(group_scale.max(axis=-1) / 127.0)                             # [n]
        df = d.astype(np.float32)[:, None]
        sc = np.clip(np.ceil(np.divide(group_scale, df, out=np.zeros_like(group_scale),
                                        where=df > 0)), -128, 127).astype(np.int8)
        step = (df * sc.astype(np.float32))[..., None]                        # [n, 16, 1]
        q = np.clip(np.round(np.divide(blocks, step, out=np.zeros_like(blocks), where=step > 0)),
                    -32, 31).astype(np.int32) + 32
        q = q.reshape(n, 2, 4, 32)                                            # half h, s, l
        ql = np.zeros((n, 2, 2, 32), np.uint8)                                # half, s & 1, l
        ql |= (q[:, :, 0:2] & 15).astype(np.uint8)
        ql |= ((q[:, :, 2:4] & 15) << 4).astype(np.uint8)
        qh = np.zeros((n, 2, 32), np.uint8)
        for s in range(4):
            qh |= (((q[:, :, s] >> 4) & 3) << (2 * s)).astype(np.uint8)
        packed = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                                 d.reshape(n, 1).view(np.uint8)], axis=1)
        return packed.reshape(rows, -1)
    qmax = 15 if layout == "q4_k" else 31
    low = np.minimum(blocks.min(axis=-1), 0.0)                                # [n, 8]
    scale = (blocks.max(axis=-1) - low) / qmax
    d, dmin = f16(scale.max(axis=-1) / 63.0), f16((-low).max(axis=-1) / 63.0)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)),
                 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-low, mf, out=np.zeros_like(low), where=mf > 0)),
                 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(blocks + (mf * mn)[..., None], step, out=np.zeros_like(blocks),
                                   where=step > 0)), 0, qmax).astype(np.uint8)  # [n, 8, 32]
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(n, 128)
    parts = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), scales]
    if layout == "q5_k":
        qh = np.zeros((n, 32), np.uint8)
        for j in range(8):
            qh |= ((q[:, j] >> 4) & 1) << j
        parts.append(qh)
    return np.concatenate(parts + [qs], axis=1).reshape(rows, -1)


def _child(code: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_library_runs_on_torchs_openmp_runtime(tmp_path):
    """One pool: after loading, the process maps exactly one OpenMP runtime (torch's), and a
    parallel region of the library gets the threads asked for."""
    found = _child(
        "import json, torch; torch.set_num_threads(2)\n"
        "from fuel.kernels import native\n"
        "lib = native.load()\n"
        "maps = {l.split()[-1] for l in open('/proc/self/maps') if 'gomp' in l or 'libomp' in l}\n"
        "print(json.dumps({'maps': sorted(maps), 'threads': lib.pool_threads(2),\n"
        "                  'torch': torch.__file__}))",
        {"FUEL_CACHE_DIR": str(tmp_path)})
    assert len(found["maps"]) == 1, found["maps"]
    assert Path(found["maps"][0]).resolve().is_relative_to(Path(found["torch"]).parent.resolve())
    assert found["threads"] == 2


def test_no_compiler_is_a_reason_not_a_crash(tmp_path):
    found = _child(
        "import json\nfrom fuel.kernels import native\nlib = native.load()\n"
        "print(json.dumps({'unavailable': isinstance(lib, native.Unavailable),"
        " 'reason': getattr(lib, 'reason', '')}))",
        {"FUEL_CACHE_DIR": str(tmp_path), "CC": str(tmp_path / "no-such-cc")})
    assert found["unavailable"] and "no-such-cc" in found["reason"]
    assert not list(tmp_path.glob("native/*/*.so")), "nothing half-built is left behind"


def test_a_damaged_library_is_rebuilt(tmp_path):
    env = {"FUEL_CACHE_DIR": str(tmp_path)}
    # The cache's library (an install-time build beside the sources is set aside: the test
    # damages what it loads, and must not damage the installed one).
    code = ("import json\nfrom pathlib import Path\nfrom fuel.kernels import native\n"
            f"native.INSTALLED = Path({str(tmp_path / 'not-installed')!r})\nlib = native.load()\n"
            "print(json.dumps({'path': str(getattr(lib, 'path', '')), "
            "'reason': getattr(lib, 'reason', '')}))")
    first = _child(code, env)
    assert first["path"], first["reason"]
    Path(first["path"]).write_bytes(b"not an ELF file")
    second = _child(code, env)
    assert second["path"] == first["path"] and Path(second["path"]).read_bytes()[:4] == b"\x7fELF"


def _quant_request(layout: str, cols: int = 128):
    from tests.jit.helpers import request_for

    graph = Graph()
    x = graph.input("x", (1, cols), DType.F32)
    w = graph.input("w", (64, packed_row_bytes(layout, cols)), DType.U8)
    node = graph.fused(FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear(layout, cols), x, w)
    return request_for(graph, node)


@pytest.mark.parametrize("layout, cols", [("q4_1", 128), ("bf16", 128), ("f16", 128),
                                          ("q4_k", 256), ("q6_k", 256)])
def test_the_cpu_synthesizer_answers_quantized_matmuls_natively(lib, layout, cols, tmp_path):
    """q4_1 (a format with an 8-bit-activation kernel) gets it, with its stated error bound;
    bf16 and f16 get the f32-activation kernel for decode rows (their bound is zero there); a
    prompt chunk of a format torch multiplies natively here (bf16 on AVX-512 BF16) runs torch's
    GEMM in it, rounding the activations, within the stated bound, and one it does not (f16)
    the native GEMM, within the plain f32 tolerance; the others get the f32-activation kernel,
    within the recipe tolerance alone."""
    from fuel.jit.native_synth import KERNEL_SOURCE, KERNEL_SOURCE_Q8, CpuSynthesizer
    from fuel.kernels.torch_kernels import HALF_GEMM_NATIVE

    synth = CpuSynthesizer(cache_dir=tmp_path)
    answer = synth.synthesize(_quant_request(layout, cols))
    assert isinstance(answer, Synthesized) and answer.entry_point.startswith("native:")
    kernel = synth.take_kernel(answer.entry_point)
    q8 = layout in native.Q8_FORMATS
    assert kernel.kernel_source == (KERNEL_SOURCE_Q8 if q8 else KERNEL_SOURCE)
    half = layout in ("bf16", "f16")
    assert (kernel.error_bound is not None) == (q8 or half)
    w = random_blocks(layout, 64, cols, torch.Generator().manual_seed(1))
    for rows in (1, 24):
        x = torch.randn(rows, cols)
        want = x @ dequantize(w, layout, cols).T
        bound = kernel.error_bound((x, w), want) if kernel.error_bound is not None else None
        assert verify(kernel.run(x, w), want, TOLERANCE, bound).ok
        if half:
            assert (bound.max() == 0) == (rows == 1)  # exact f32 activations for decode rows
            rounds = {"bf16": torch.bfloat16, "f16": torch.float16}[layout] in HALF_GEMM_NATIVE
            if rows > 1:  # a chunk in torch's 16-bit GEMM rounds: outside the f32 tolerance
                assert verify(kernel.run(x, w), want, TOLERANCE).ok != rounds


def test_fuel_q8_activations_0_keeps_f32_activations(lib, tmp_path, monkeypatch):
    from fuel.jit.native_synth import KERNEL_SOURCE, CpuSynthesizer

    assert CpuSynthesizer(cache_dir=tmp_path).name == "numba+native+q8"
    monkeypatch.setenv("FUEL_Q8_ACTIVATIONS", "0")
    synth = CpuSynthesizer(cache_dir=tmp_path)
    # the name is in the program cache's key: a program adopted with q8 kernels is not restored
    assert synth.name == "numba+native"
    kernel = synth.take_kernel(synth.synthesize(_quant_request("q4_1", 128)).entry_point)
    assert kernel.kernel_source == KERNEL_SOURCE and kernel.error_bound is None
    w = random_blocks("q4_1", 64, 128, torch.Generator().manual_seed(1))
    x = torch.randn(1, 128)
    assert verify(kernel.run(x, w), x @ dequantize(w, "q4_1", 128).T, TOLERANCE).ok


def test_layouts_the_library_lacks_go_to_numba(tmp_path):
    from fuel.jit.native_synth import CpuSynthesizer

    synth = CpuSynthesizer(cache_dir=tmp_path)
    graph = Graph()
    x = graph.input("x", (1, 256), DType.F32)
    w = graph.input("w", (4, packed_row_bytes("q3_k", 256)), DType.U8)
    node = graph.fused(FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear("q3_k", 256), x, w)
    from tests.jit.helpers import request_for

    answer = synth.synthesize(request_for(graph, node))
    assert isinstance(answer, Declined) and "gguf/q3_k" in answer.reason  # numba's own reason


@pytest.mark.parametrize("user, expected", [({}, "by load"), ({"GOMP_SPINCOUNT": "7"}, "7"),
                                            ({"OMP_WAIT_POLICY": "active"}, None)])
def test_importing_fuel_sets_the_pools_idle_spin_by_load_unless_the_user_chose(user, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", "import json, os, sys, fuel\n"
                           "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules]))"],
                          capture_output=True, text=True, env={**env, **user}, timeout=120)
    spin, torch_loaded = json.loads(done.stdout)
    from fuel.kernels.threads import SPIN_BUSY, SPIN_IDLE

    # By load: one of the two counts (which one depends on what else runs at that instant).
    assert spin in (str(SPIN_IDLE), str(SPIN_BUSY)) if expected == "by load" else spin == expected
    assert not torch_loaded  # set before torch's OpenMP runtime loads


def test_the_load_is_what_runs_now_not_the_minute_average():
    from fuel.kernels.threads import current_load, runnable_from

    assert runnable_from("2.41 2.20 1.90 1/79 13554") == 1
    assert runnable_from("0.10 0.20 0.30 5/310 99") == 5 and runnable_from("0.1 0.2") is None
    # A busy minute behind us, nothing running now (ourselves only): an idle core.
    assert current_load(read=lambda: "2.41 2.20 1.90 1/79 13554") == 0.0
    # The least of the samples: a task that ran at one instant is not load.
    reads = iter(["0 0 0 4/80 1", "0 0 0 2/80 1", "0 0 0 5/80 1"])
    assert current_load(samples=3, read=lambda: next(reads)) == 1.0
    reads = iter(["0 0 0 3/80 1", "0 0 0 3/80 1"])
    assert current_load(samples=2, read=lambda: next(reads)) == 2.0


def test_the_spin_is_long_with_an_idle_core_and_short_on_a_busy_machine():
    from fuel.kernels.threads import SPIN_BUSY, SPIN_IDLE, spin_count_for

    assert spin_count_for(0.3, 2) == SPIN_IDLE > spin_count_for(1.8, 2) == SPIN_BUSY
    assert spin_count_for(6.5, 2) == SPIN_BUSY and spin_count_for(2.5, 4) == SPIN_IDLE


def test_rope_equals_the_rotate_half_recipe_on_strided_heads(lib):
    generator = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 15, 64, generator=generator)
    cos, sin = torch.randn(5, 1, 64, generator=generator), torch.randn(5, 1, 64, generator=generator)
    x = qkv[:, 3:12]  # heads viewed out of a fused projection: rows and heads strided
    first, second = x.chunk(2, dim=-1)
    want = x * cos + torch.cat((-second, first), dim=-1) * sin
    assert verify(lib.rope(x, cos, sin), want, TOLERANCE).ok
    assert lib.rope(x.double(), cos.double(), sin.double()) is None  # not f32: torch runs it
    assert lib.rope(x.transpose(1, 2), cos, sin) is None  # last dim not contiguous



def test_argmax_keeps_torchs_first_maximum_and_nan_rules(lib):
    x = torch.randn(4, 49152)
    x[1, 7] = x[1, 9] = x[1].max() + 1  # a tie: the first index
    x[2, 100] = float("nan")  # a NaN is the maximum
    x[3, 5] = x[3, 50] = float("nan")
    assert lib.argmax(x).tolist() == torch.argmax(x, -1).tolist()
    assert lib.argmax(x[:, ::2]) is None and lib.argmax(x.double()) is None


def test_kv_write_puts_each_row_in_its_slot_and_refuses_a_slot_outside(lib):
    cache = torch.zeros(4, 2, 3, 5)
    rows = torch.randn(3, 3, 5)
    slots = torch.tensor([7, 0, 4])
    want = cache.clone()
    want.view(-1, 3, 5).index_copy_(0, slots, rows)
    assert lib.kv_write(cache, rows, slots) and torch.equal(cache, want)
    with pytest.raises(IndexError):
        lib.kv_write(cache, rows, torch.tensor([1, 8, 2]))
    assert torch.equal(cache, want), "nothing written when a slot is out of range"
    assert not lib.kv_write(cache, rows, slots.to(torch.int32))  # torch's kernel takes it


@pytest.mark.parametrize("index", [torch.int64, torch.int32])
def test_paged_attention_decode_equals_the_numba_template(lib, index, tmp_path):
    """The native decode body against the numba template (itself verified against the recipe):
    GQA, partial and full block tables, a sequence that sees nothing."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(3, 6, 1, 16, generator=generator)
    k_cache, v_cache = (torch.randn(10, 4, 2, 16, generator=generator) for _ in range(2))
    table = torch.stack([torch.randperm(10, generator=generator)[:3] for _ in range(3)]).to(index)
    lens = torch.tensor([12, 5, 0]).to(index)
    got = lib.paged_attn(q, k_cache, v_cache, table, lens, 0.25, None)
    scores = []
    for b in range(3):
        rows = torch.cat([k_cache[int(blk)] for blk in table[b]])[: int(lens[b])]  # [t, 2, 16]
        vals = torch.cat([v_cache[int(blk)] for blk in table[b]])[: int(lens[b])]
        for h in range(6):
            kv = h // 3
            if int(lens[b]) == 0:
                assert torch.isnan(got[b, h, 0]).all()
                continue
            weights = torch.softmax(rows[:, kv] @ q[b, h, 0] * 0.25, 0)
            scores.append((got[b, h, 0] - weights @ vals[:, kv]).abs().max().item())
    assert max(scores) < 1e-5
    with pytest.raises(IndexError):
        lib.paged_attn(q, k_cache, v_cache, torch.full_like(table, 10), lens, 0.25, None)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_paged_attention_reads_a_half_precision_cache_as_its_widened_rows(lib, half):
    """Half-precision caches: each row widened as it is read gives exactly what the f32 kernel
    gives over the caches widened whole (the arithmetic after the load is the same)."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 1, 16, generator=generator)
    k_cache, v_cache = (torch.randn(10, 4, 2, 16, generator=generator).to(half) for _ in range(2))
    table = torch.stack([torch.randperm(10, generator=generator)[:3] for _ in range(2)])
    lens = torch.tensor([11, 4])
    got = lib.paged_attn(q, k_cache, v_cache, table, lens, 0.25, None)
    want = lib.paged_attn(q, k_cache.float(), v_cache.float(), table, lens, 0.25, None)
    assert got is not None and torch.equal(got, want)
    assert lib.paged_attn(q.to(half), k_cache, v_cache, table, lens, 0.25, None) is None


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_rows_round_as_torch_rounds_them_and_land_in_a_half_cache(lib, half):
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(4096, generator=generator) * torch.logspace(-30, 30, 4096)
    x[:6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 65504.0, 65520.0])
    rounded = lib.cast_half(x, half)
    assert torch.equal(rounded.view(torch.int16), x.to(half).view(torch.int16))
    assert lib.cast_half(torch.tensor([float("nan")]), half).isnan().all()
    cache = torch.zeros(4, 2, 3, 5, dtype=half)
    rows = torch.randn(3, 3, 5, generator=generator).to(half)
    slots = torch.tensor([7, 0, 4])
    want = cache.clone()
    want.view(-1, 3, 5).index_copy_(0, slots, rows)
    assert lib.kv_write(cache, rows, slots) and torch.equal(cache, want)
    assert not lib.kv_write(cache, rows.float(), slots)  # rows must be the cache's dtype


@pytest.mark.parametrize("layout", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k",
                                    "q6_k", "f16", "bf16", "int8_channel"])
def test_native_dequantize_is_bit_equal_to_the_gguf_reference(lib, layout):
    """The DEQUANTIZE primitive's CPU kernel runs the native dequantizer: it must give exactly
    the reference's values (arm 0, the oracle, is computed with it), leading dims kept."""
    generator = torch.Generator().manual_seed(7)
    if layout in ("f16", "bf16"):
        half = torch.float16 if layout == "f16" else torch.bfloat16
        w = torch.randn(3, 5, 512, generator=generator).to(half).view(torch.uint8)
    else:
        w = random_blocks(layout, 15, 512, generator).reshape(3, 5, -1)
    got = lib.dequantize(layout, w, 512)
    assert got is not None and got.shape == (3, 5, 512)
    assert torch.equal(got, dequantize(w, layout, 512))
    assert lib.dequantize("q2_k", w, 512) is None  # a format the library lacks: the caller's


def test_an_f16_chunk_that_overflows_f16_is_computed_on_the_f32_path(lib, tmp_path):
    """f16 tops out at 65504: a prompt chunk whose product overflows it must give the recipe's
    finite values (the f32 path), never infinities."""
    from fuel.jit.native_synth import CpuSynthesizer

    synth = CpuSynthesizer(cache_dir=tmp_path)
    kernel = synth.take_kernel(synth.synthesize(_quant_request("f16", 128)).entry_point)
    w = torch.full((64, 128), 60.0).to(torch.float16).view(torch.uint8)
    x = torch.full((24, 128), 50.0)  # 128 * 60 * 50 = 384,000 per output: past f16's range
    out = kernel.run(x, w)
    assert torch.isfinite(out).all()
    assert verify(out, x @ dequantize(w, "f16", 128).T, TOLERANCE).ok


@pytest.mark.parametrize("keepdim", [False, True])
def test_the_argmax_kernel_answers_like_torch_with_and_without_keepdim(lib, keepdim):
    from fuel.graph import DType, Graph, OpKind, lower
    from fuel.kernels import cpu_table
    from fuel.runtime import compile_program

    g = Graph()
    x = g.input("x", [3, 7], DType.F32)
    pick = g.prim(OpKind.ARGMAX, x, dim=-1, keepdim=keepdim)
    program = compile_program(g, lower(g, [pick]), cpu_table())
    rows = torch.tensor([[1.0, 5.0, 5.0, 0.0, -1.0, 2.0, 3.0],
                         [0.0, float("nan"), 9.0, float("nan"), 1.0, 1.0, 1.0],
                         [-3.0, -2.0, -1.0, -1.0, -9.0, -9.0, -1.0]])
    want = torch.argmax(rows, -1, keepdim)
    assert want.tolist() == ([[1], [1], [2]] if keepdim else [1, 1, 2])
    kernel, _ = program.run_timed({"x": rows})  # node by node: the table's kernel
    step_list = program.run({"x": rows})  # the program laid out as one native call
    for got in (kernel[pick], step_list[pick]):
        assert got.shape == want.shape and got.tolist() == want.tolist()


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_decode_attention_of_64_wide_heads_follows_a_permuted_table_and_the_softcap(lib, softcap):
    # Why: an f32 cache of 64-wide heads scores eight positions at a time and sums the values
    # in registers (gemv.c attn_scores8 / attn_values64); each position's row must still come
    # through the sequence's own block table, the cap apply to every score, and a context that
    # is not a multiple of eight keep its last positions. f64 reference, per sequence and head.
    generator = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, block, blocks = 6, 2, 64, 4, 12
    k_cache = torch.randn(blocks, block, kv_heads, dim, generator=generator) * 2
    v_cache = torch.randn(blocks, block, kv_heads, dim, generator=generator)
    q = torch.randn(3, heads, 1, dim, generator=generator) * 2
    table = torch.stack([torch.randperm(blocks, generator=generator)[:6] for _ in range(3)]).to(torch.int32)
    lens = torch.tensor([21, 8, 3], dtype=torch.int32)
    got = lib.paged_attn(q, k_cache, v_cache, table, lens, 0.125, softcap or None)
    for b in range(3):
        rows = torch.cat([k_cache[int(blk)] for blk in table[b]])[: int(lens[b])].double()
        vals = torch.cat([v_cache[int(blk)] for blk in table[b]])[: int(lens[b])].double()
        for h in range(heads):
            scores = rows[:, h // 3] @ q[b, h, 0].double() * 0.125
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            want = torch.softmax(scores, 0) @ vals[:, h // 3]
            assert float((got[b, h, 0].double() - want).abs().max()) < 1e-5, (b, h)


@pytest.mark.parametrize("context", [7, 100, 300, 2000])
def test_decode_attention_over_a_long_context_matches_f64_softmax_attention(lib, context):
    # Why: the softmax's exponentials run eight at a time (a polynomial exp, ~1 ulp) and long
    # contexts share their units over the pool; both must still give attention as f64 does,
    # within f32 rounding, and a NaN score must stay NaN as it does in the recipe.
    torch.manual_seed(context)
    heads, kv_heads, dim, block, width = 8, 2, 64, 16, 128
    k_cache = (torch.randn(width, block, kv_heads, dim) * 2)
    v_cache = torch.randn(width, block, kv_heads, dim)
    q = torch.randn(1, heads, 1, dim) * 2
    table = torch.arange(width, dtype=torch.int64).reshape(1, width)
    lens = torch.tensor([context], dtype=torch.int64)
    out = lib.paged_attn(q, k_cache, v_cache, table, lens, dim ** -0.5, 0.0)
    keys = k_cache.reshape(-1, kv_heads, dim)[:context].double().permute(1, 0, 2)
    values = v_cache.reshape(-1, kv_heads, dim)[:context].double().permute(1, 0, 2)
    group = heads // kv_heads
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double(), keys.repeat_interleave(group, 0)[None], values.repeat_interleave(group, 0)[None],
        scale=dim ** -0.5)
    assert float((out.double() - reference).abs().max()) < 1e-5
    threads = torch.get_num_threads()
    try:  # units shared over the pool (100 positions and up) compute exactly as one thread does
        torch.set_num_threads(1)
        alone = lib.paged_attn(q, k_cache, v_cache, table, lens, dim ** -0.5, 0.0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, alone)
    q[0, 3, 0, 5] = float("nan")
    poisoned = lib.paged_attn(q, k_cache, v_cache, table, lens, dim ** -0.5, 0.0)
    assert torch.isnan(poisoned[0, 3]).all() and not torch.isnan(poisoned[0, 4]).any()


@pytest.mark.parametrize("cols", [33, 130, 576])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_int8_channel_rows_at_odd_widths_equal_the_dequantized_reference(lib, rows, cols):
    """Per-channel int8 rows (``cols`` int8 weights, then the row's f32 scale): widths that leave
    a scalar tail after the 16-wide loop (33, 130), output counts that leave a partial 4-row
    group (37), the streamed path (1, 3 rows) and the dequantized tiles (6 rows)."""
    generator = torch.Generator().manual_seed(rows * cols)
    w = random_blocks("int8_channel", 37, cols, generator)
    assert w.shape == (37, cols + 4)
    x = torch.randn(rows, cols, generator=generator)
    want = x @ dequantize(w, "int8_channel", cols).T
    check = verify(lib.matmul("int8_channel", x, w, cols), want, TOLERANCE)
    assert check.ok, check.report
    from fuel.kernels.quant_blocks import int8_channel_parts, pack_int8_channel

    q, scale = int8_channel_parts(w, cols)  # the scale is each row's tail: doubling one doubles it
    scale = scale.clone()
    scale[5] *= 2
    scaled = pack_int8_channel(q, scale)
    out = lib.matmul("int8_channel", x, scaled, cols)
    assert torch.allclose(out[:, 5], 2 * want[:, 5], rtol=1e-4, atol=1e-6)
    assert torch.equal(out[:, 4], lib.matmul("int8_channel", x, w, cols)[:, 4])


def test_native_silu_mul_equals_torch_within_the_f32_tolerance(lib):
    """The step list's silu_mul (exponentials eight at a time, a scalar tail) against torch's
    ``silu(gate) * up``: every width class (a multiple of 8, a tail), gates far past exp's
    range both ways, zeros, and a NaN that must stay NaN."""
    import ctypes

    generator = torch.Generator().manual_seed(3)
    for n in (1536, 1541, 7):
        gate = torch.randn(n, generator=generator) * 6
        gate[:4] = torch.tensor([-200.0, -88.0, 0.0, 95.0])[: min(4, n)]
        up = torch.randn(n, generator=generator)
        out = torch.empty(n)
        lib._lib.fuel_silu_mul(ctypes.c_void_p(gate.data_ptr()), ctypes.c_void_p(up.data_ptr()),
                               ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(n))
        want = torch.nn.functional.silu(gate) * up
        check = verify(out, want, TOLERANCE)
        assert check.ok, f"{n}: {check.report}"
    gate = torch.tensor([float("nan")] + [1.0] * 8)
    out, up = torch.empty(9), torch.ones(9)
    lib._lib.fuel_silu_mul(ctypes.c_void_p(gate.data_ptr()), ctypes.c_void_p(up.data_ptr()),
                           ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(9))
    assert torch.isnan(out[0]) and torch.isfinite(out[1:]).all()


_HAS_AVX512 = "avx512f" in (Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else [])
"""Whether this CPU (and so the -march=native build) has AVX-512, the native prompt-chunk
attention's instruction set."""


def _prefill_reference(q, k_cache, v_cache, table, lens, scale):
    """The paged-attention recipe's semantics in f64, one sequence and head at a time: query i
    of L sees positions up to len - L + i (capped at the table's capacity); NaN when it sees
    nothing."""
    batch, heads, rows, _ = q.shape
    block, kv_heads = k_cache.shape[1], k_cache.shape[2]
    capacity = table.shape[1] * block
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for b in range(batch):
        keys = torch.cat([k_cache[int(blk)] for blk in table[b]]).double()  # [capacity, kv, D]
        vals = torch.cat([v_cache[int(blk)] for blk in table[b]]).double()
        for h in range(heads):
            kv = h // (heads // kv_heads)
            for i in range(rows):
                seen = min(int(lens[b]) - rows + i + 1, capacity)
                if seen <= 0:
                    continue
                weights = torch.softmax(keys[:seen, kv] @ q[b, h, i].double() * scale, 0)
                out[b, h, i] = weights @ vals[:seen, kv]
    return out


@pytest.mark.parametrize("half", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_attention_equals_the_recipe_on_f32_and_half_caches(lib, half, head_dim):
    """The native prompt-chunk attention: GQA, two sequences of different lengths through
    shuffled block tables, row counts that are not a multiple of its row blocks, contexts
    longer than the chunk (a second chunk), past one 64-key block, rows that see nothing (NaN)
    and a context longer than the table (capped), on f32 caches and on bf16/f16 caches widened
    as read."""
    generator = torch.Generator().manual_seed(head_dim)
    rows, kv_heads, heads, block = 70, 2, 6, 16
    q = torch.randn(3, heads, rows, head_dim, generator=generator)
    k_cache, v_cache = (torch.randn(40, block, kv_heads, head_dim, generator=generator)
                        for _ in range(2))
    if half is not None:
        k_cache, v_cache = k_cache.to(half), v_cache.to(half)
    table = torch.stack([torch.randperm(40, generator=generator)[:12] for _ in range(3)])
    lens = torch.tensor([150, 60, 400])  # a later chunk; 10 rows that see nothing; capped at 192
    # as a step feeds it: heads and rows permuted out of the projection (a strided view)
    strided = q.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    for index, queries in ((torch.int64, q), (torch.int32, strided)):
        got = lib.prefill_attn(queries, k_cache, v_cache, table.to(index), lens.to(index), 0.3)
        if not _HAS_AVX512:  # no kernel: the caller's SDPA stands (tests/jit)
            assert got is None
            continue
        want = _prefill_reference(q, k_cache.float(), v_cache.float(), table, lens, 0.3)
        assert got.is_contiguous() and torch.equal(torch.isnan(got), torch.isnan(want))
        seen = ~torch.isnan(want)
        assert seen.any() and (got[seen].double() - want[seen]).abs().max().item() < 2e-5


def test_prefill_attention_declines_what_it_has_no_kernel_for_and_refuses_a_block_outside(lib):
    q = torch.randn(1, 4, 8, 32)
    cache = torch.randn(4, 16, 2, 32)
    table, lens = torch.arange(4)[None], torch.tensor([8])
    assert lib.prefill_attn(q, cache, cache, table, lens, 0.2) is None  # head dim 32: SDPA's
    q, cache = torch.randn(1, 4, 8, 64), torch.randn(4, 16, 2, 64)
    assert lib.prefill_attn(q.double(), cache, cache, table, lens, 0.2) is None
    if not _HAS_AVX512:
        assert lib.prefill_attn(q, cache, cache, table, lens, 0.2) is None
        return
    with pytest.raises(IndexError):
        lib.prefill_attn(q, cache, cache, torch.tensor([[0, 9, 1, 2]]), torch.tensor([30]), 0.2)


def test_the_synthesized_paged_kernel_runs_a_prompt_chunk_on_the_native_flash_attention(
        lib, tmp_path, monkeypatch):
    """The CPU synthesizer's paged-attention kernel at prompt-chunk rows calls the native
    prompt-chunk attention (where this CPU has it) and equals the recipe's semantics."""
    from fuel.jit.native_synth import CpuSynthesizer
    from tests.jit.helpers import request_for

    graph = Graph()
    q = graph.input("q", (1, 6, 20, 64), DType.F32)
    k = graph.input("k", (8, 16, 2, 64), DType.F32)
    v = graph.input("v", (8, 16, 2, 64), DType.F32)
    t, n = graph.input("t", (1, 8), DType.I64), graph.input("n", (1,), DType.I64)
    node = graph.fused(FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(0.125, 16), q, k, v, t, n)
    synth = CpuSynthesizer(cache_dir=tmp_path)
    answer = synth.synthesize(request_for(graph, node))
    assert isinstance(answer, Synthesized) and answer.entry_point.startswith("native:")
    kernel = synth.take_kernel(answer.entry_point)
    calls, calls_native = [], []
    real = type(lib).prefill_attn

    def spy(self, *args):
        calls.append(args[0].shape)
        out = real(self, *args)
        calls_native.append(out is not None)
        return out

    monkeypatch.setattr(type(lib), "prefill_attn", spy)
    generator = torch.Generator().manual_seed(8)
    # q as a step hands it over: permuted out of the projection's [rows, heads, dim]
    qv = torch.randn(1, 20, 6, 64, generator=generator).permute(0, 2, 1, 3)
    kc, vc = (torch.randn(8, 16, 2, 64, generator=generator) for _ in range(2))
    table, lens = torch.randperm(8, generator=generator)[None], torch.tensor([90])
    got = kernel.run(qv, kc, vc, table, lens)
    assert calls == [torch.Size([1, 6, 20, 64])]
    if _HAS_AVX512:  # the native kernel took the strided view (SDPA on it was ~10x slower)
        assert calls_native == [True]
    want = _prefill_reference(qv, kc, vc, table, lens, 0.125)
    assert (got.double() - want).abs().max().item() < 2e-5
