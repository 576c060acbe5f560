"""Every fused op's CPU kernel equals its own recipe's decomposition; attention and paged
attention also equal an independent formula (torch SDPA over the gathered cache).

Tolerances are the table's ``RECIPE_TOLERANCE`` per dtype (f32 2e-5, bf16 1e-2 absolute + 1.6e-2
relative): the recipe rounds every step to the storage dtype while the kernels accumulate in
f32, so bf16 differences of up to two ulps are expected; anything beyond is a wrong kernel.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, decompose
from fuel.kernels import RECIPE_TOLERANCE, cpu_table
from fuel.kernels.torch_kernels import torch_dtype
from fuel.runtime import execute

TABLE = cpu_table()
DTYPES = [DType.F32, DType.BF16]


def _rand(gen, dims, dtype, scale=1.0):
    return (torch.randn(dims, generator=gen, dtype=torch.float32) * scale).to(torch_dtype(dtype))


def _rope_tables(seq, width, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float32) / width))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(torch_dtype(dtype)), angles.sin().to(torch_dtype(dtype))


def _case(name, dtype, gen):
    """(fused id, params, [(feed name, tensor)])."""
    r = lambda *dims, scale=1.0: _rand(gen, list(dims), dtype, scale)  # noqa: E731
    if name == "softmax":
        return FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), [r(3, 5, 17, scale=3.0)]
    if name == "rms_gain":
        return FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-6), [r(2, 3, 64), 1.0 + r(64, scale=0.1)]
    if name == "rms_plain":
        return FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-5, has_gain=False), [r(4, 32)]
    if name == "layer_norm":
        return FusedOps.LAYER_NORM, FusedOpParams.LayerNorm(1e-5), [r(4, 32), r(32), r(32)]
    if name == "rope":
        cos, sin = _rope_tables(6, 16, dtype)
        return FusedOps.ROPE, FusedOpParams.Rope(), [r(2, 4, 6, 16), cos, sin]
    if name == "linear":
        return FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(), [r(5, 32), r(24, 32, scale=0.2)]
    if name == "linear_bias":
        return (FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(has_bias=True),
                [r(2, 5, 32), r(24, 32, scale=0.2), r(24)])
    if name == "silu_mul":
        return FusedOps.SILU_MUL, FusedOpParams.SiluMul(), [r(4, 48), r(4, 48)]
    if name == "flash_causal_gqa":
        return (FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(1 / math.sqrt(16)),
                [r(2, 8, 5, 16), r(2, 2, 5, 16), r(2, 2, 5, 16)])
    if name == "flash_decode_rows":  # Sq < Sk: bottom-right causal alignment
        return (FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.25),
                [r(1, 4, 3, 16), r(1, 2, 9, 16), r(1, 2, 9, 16)])
    if name == "flash_full":
        return (FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.25, causal=False),
                [r(1, 4, 3, 16), r(1, 4, 7, 16), r(1, 4, 7, 16)])
    if name == "flash_softcap":
        return (FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.5, softcap=5.0),
                [r(1, 4, 4, 8, scale=3.0), r(1, 1, 4, 8, scale=3.0), r(1, 1, 4, 8)])
    raise AssertionError(name)


KERNEL_CASES = ["softmax", "rms_gain", "rms_plain", "layer_norm", "rope", "linear", "linear_bias",
                "silu_mul", "flash_causal_gqa", "flash_decode_rows", "flash_full", "flash_softcap"]


def _fused_and_decomposed(fused_id, params, tensors, dtype, symbolic_axis=None):
    g = Graph()
    inputs = []
    for i, t in enumerate(tensors):
        dims = list(t.shape)
        if symbolic_axis is not None and i in (1, 2):
            dims[symbolic_axis] = "k_len"
        inputs.append(g.input(f"in{i}", dims, dtype))
    fused = g.fused(fused_id, params, *inputs)
    root = decompose(g, fused)
    assert root != fused, "every fused op decomposes"
    return g, fused, root, {f"in{i}": t for i, t in enumerate(tensors)}


def _assert_close(actual, expected, dtype):
    atol, rtol = RECIPE_TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_equals_its_recipe_decomposition(case, dtype):
    gen = torch.Generator().manual_seed(KERNEL_CASES.index(case))
    fused_id, params, tensors = _case(case, dtype, gen)
    g, fused, root, feeds = _fused_and_decomposed(fused_id, params, tensors, dtype)
    out = execute(g, [fused, root], TABLE, feeds)
    assert out[fused].dtype == torch_dtype(dtype) and out[fused].shape == out[root].shape
    _assert_close(out[fused], out[root], dtype)


def test_flash_attn_with_symbolic_k_len_runs_for_several_lengths():
    gen = torch.Generator().manual_seed(7)
    for k_len in (1, 6, 11):
        tensors = [_rand(gen, [1, 4, 1, 8], DType.F32), _rand(gen, [1, 2, k_len, 8], DType.F32),
                   _rand(gen, [1, 2, k_len, 8], DType.F32)]
        g, fused, root, feeds = _fused_and_decomposed(
            FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.3), tensors, DType.F32, symbolic_axis=2)
        assert g.node(fused).shape.dims == (1, 4, 1, 8)
        out = execute(g, [fused, root], TABLE, feeds)
        _assert_close(out[fused], out[root], DType.F32)


def _naive_attention(q, k, v, scale, causal, softcap=None):
    """Independent formula in float64: explicit GQA head mapping and bottom-right causal mask."""
    q, k, v = q.double(), k.double(), v.double()
    heads, kv_heads = q.shape[1], k.shape[1]
    k = torch.stack([k[:, h // (heads // kv_heads)] for h in range(heads)], dim=1)
    v = torch.stack([v[:, h // (heads // kv_heads)] for h in range(heads)], dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        for i in range(sq):
            scores[:, :, i, i + (sk - sq) + 1:] = -math.inf
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("case", ["flash_causal_gqa", "flash_decode_rows", "flash_full", "flash_softcap"])
def test_flash_attn_kernel_and_recipe_equal_an_independent_formula(case):
    gen = torch.Generator().manual_seed(11)
    fused_id, params, tensors = _case(case, DType.F32, gen)
    g, fused, root, feeds = _fused_and_decomposed(fused_id, params, tensors, DType.F32)
    out = execute(g, [fused, root], TABLE, feeds)
    expected = _naive_attention(*tensors, params.softmax_scale, params.causal, params.softcap)
    torch.testing.assert_close(out[fused].double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[root].double(), expected, atol=1e-5, rtol=1e-5)


def _paged_setup(gen, dtype, queries, context_lens, block_size=4, kv_heads=2, heads=4, head_dim=8,
                 blocks=12, softcap=None):
    batch, per_seq = len(context_lens), max(-(-c // block_size) for c in context_lens) + 1
    # A shuffled, non-contiguous block assignment; unused entries name block 0.
    perm = torch.randperm(blocks, generator=gen).tolist()
    table = torch.zeros(batch, per_seq, dtype=torch.int64)
    for b, length in enumerate(context_lens):
        for j in range(-(-length // block_size)):
            table[b, j] = perm.pop()
    tensors = [_rand(gen, [batch, heads, queries, head_dim], dtype),
               _rand(gen, [blocks, block_size, kv_heads, head_dim], dtype),
               _rand(gen, [blocks, block_size, kv_heads, head_dim], dtype),
               table.to(torch.uint32), torch.tensor(context_lens).to(torch.uint32)]
    params = FusedOpParams.PagedAttn(1 / math.sqrt(head_dim), block_size, softcap)
    g = Graph()
    dtypes = [dtype, dtype, dtype, DType.U32, DType.U32]
    inputs = [g.input(f"in{i}", list(t.shape), d) for i, (t, d) in enumerate(zip(tensors, dtypes))]
    node = g.fused(FusedOps.PAGED_ATTN, params, *inputs)
    return g, node, tensors, params


def _sdpa_over_gathered_cache(tensors, params):
    q, k_cache, v_cache, table, lens = tensors
    table, lens = table.to(torch.int64), lens.to(torch.int64)
    outs = []
    for b in range(q.shape[0]):
        length, queries = int(lens[b]), q.shape[2]
        positions = torch.arange(length)
        slots = table[b, positions // params.block_size] * params.block_size + positions % params.block_size
        k = k_cache.flatten(0, 1)[slots].permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, L, D]
        v = v_cache.flatten(0, 1)[slots].permute(1, 0, 2).unsqueeze(0)
        visible = positions.unsqueeze(0) <= (length - queries + torch.arange(queries)).unsqueeze(1)
        outs.append(F.scaled_dot_product_attention(q[b:b + 1].float(), k.float(), v.float(),
                                                   attn_mask=visible, scale=params.softmax_scale,
                                                   enable_gqa=True))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize("queries", [1, 3], ids=["decode", "verify3"])
def test_paged_attn_decomposition_equals_sdpa_over_the_gathered_cache(dtype, queries):
    gen = torch.Generator().manual_seed(queries)
    g, node, tensors, params = _paged_setup(gen, dtype, queries, context_lens=[5, 13, 3])
    root = decompose(g, node)
    assert root != node
    out = execute(g, [root], TABLE, {f"in{i}": t for i, t in enumerate(tensors)})[root]
    expected = _sdpa_over_gathered_cache(tensors, params)
    atol, rtol = RECIPE_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_residual_add_rms_norm_decomposition_equals_the_direct_formula():
    gen = torch.Generator().manual_seed(3)
    x, residual, gain = _rand(gen, [3, 32], DType.F32), _rand(gen, [3, 32], DType.F32), _rand(gen, [32], DType.F32)
    g = Graph()
    ins = [g.input(n, list(t.shape), DType.F32) for n, t in (("x", x), ("r", residual), ("g", gain))]
    node = g.fused(FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-6), *ins)
    root = decompose(g, node)
    out = execute(g, [root], TABLE, {"x": x, "r": residual, "g": gain})[root]
    total = x + residual
    torch.testing.assert_close(out[0], F.rms_norm(total, (32,), gain, 1e-6), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out[1], total)


def test_unfused_gaps_are_visible_in_the_cpu_table():
    # paged_attn and residual_add_rms_norm run decomposed on the CPU: the JIT seam's reason to exist.
    f32, u32 = DType.F32, DType.U32
    assert not TABLE.fused_kernel_available(FusedOps.PAGED_ATTN, (f32, f32, f32, u32, u32, f32), BackendId.CPU)
    assert not TABLE.fused_kernel_available(FusedOps.RESIDUAL_ADD_RMS_NORM, (f32, f32, f32, f32), BackendId.CPU)
    assert TABLE.fused_kernel_available(FusedOps.FLASH_ATTN, (f32, f32, f32, f32), BackendId.CPU)
