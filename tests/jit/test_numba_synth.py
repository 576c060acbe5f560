"""The numba synthesizer: generated row-wise kernels and the paged-attention template equal their
recipes' decompositions; everything else is declined with a precise reason."""

from __future__ import annotations

import pytest
import torch

from fuel.graph import DType, FusedOpParams, FusedOps
from fuel.jit import ArchSku, Declined, JitBudget, Synthesized
from fuel.jit.adopt import verify
from fuel.jit.numba_synth import KERNEL_SOURCE, NumbaSynthesizer
from fuel.kernels import RECIPE_TOLERANCE

from tests.jit.helpers import float_feeds, fused_node, paged, reference, request_for

F32, BF16 = DType.F32, DType.BF16

ROW_WISE = {
    "rms_norm": (FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-5), [[3, 5, 64], [64]]),
    "rms_norm_no_gain": (FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-6, has_gain=False), [[7, 48]]),
    "residual_add_rms_norm": (FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-5),
                              [[4, 96], [4, 96], [96]]),
    "softmax": (FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), [[2, 3, 33]]),
    "silu_mul": (FusedOps.SILU_MUL, FusedOpParams.SiluMul(), [[5, 40], [5, 40]]),
    # cos/sin [S, D] broadcast against x [B, H, S, D]: read by row modulo, not materialized.
    "rope": (FusedOps.ROPE, FusedOpParams.Rope(), [[2, 3, 4, 16], [4, 16], [4, 16]]),
    # cos/sin [B, 1, S, D] do not broadcast over leading axes only: the wrapper materializes.
    "rope_per_batch_tables": (FusedOps.ROPE, FusedOpParams.Rope(),
                              [[2, 3, 4, 16], [2, 1, 4, 16], [2, 1, 4, 16]]),
    "layer_norm": (FusedOps.LAYER_NORM, FusedOpParams.LayerNorm(1e-5), [[6, 32], [32], [32]]),
}


def synthesize_and_take(synth: NumbaSynthesizer, request):
    answer = synth.synthesize(request)
    assert isinstance(answer, Synthesized), answer
    kernel = synth.take_kernel(answer.entry_point)
    assert kernel is not None and kernel.kernel_source == KERNEL_SOURCE
    return kernel


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(ROW_WISE))
def test_row_wise_kernel_matches_its_decomposition(numba_synth, name, dtype):
    # Why: a kernel is correct exactly when it equals its recipe within the dtype's tolerance
    # (f32: 2e-5 abs+rel; bf16: 6e-2, the kernel computing in f32 on upcast inputs).
    fused_id, params, shapes = ROW_WISE[name]
    g, node = fused_node(fused_id, params, shapes, [dtype] * len(shapes))
    kernel = synthesize_and_take(numba_synth, request_for(g, node))
    feeds = float_feeds(g, node)
    got = kernel.run(*feeds.values())
    check = verify(got, reference(g, node, feeds), RECIPE_TOLERANCE[dtype])
    assert check.ok, check.report
    if dtype is F32:
        assert check.max_abs_error < 1e-5


@pytest.mark.parametrize("case", [
    dict(), dict(dtype=BF16), dict(softcap=5.0), dict(q_len=3), dict(index=DType.I32),
    dict(batch=1, q_heads=9, kv_heads=3, head_dim=64, block=16, per_seq=8, blocks=12),
    dict(batch=1, q_len=16, per_seq=4), dict(batch=1, q_len=16, per_seq=4, dtype=BF16),
    dict(q_len=8, per_seq=5), dict(softcap=5.0, q_len=4),
], ids=["f32", "bf16", "softcap", "three_queries", "i32_indices", "smollm2_heads",
        "prefill_whole_context", "prefill_whole_context_bf16", "prefill_after_cached_rows",
        "softcap_several_queries"])
def test_paged_attention_template_matches_its_decomposition(numba_synth, case):
    # Why: the template must compute the recipe: gather through the block table, mask by the
    # context length (queries at the last positions), GQA groups, soft-cap when present; at
    # several query rows its prefill body (one causal SDPA call) must too, both when the chunk
    # is the whole context (is_causal) and when it follows cached rows (an offset mask).
    g, node, feeds = paged(**case)
    kernel = synthesize_and_take(numba_synth, request_for(g, node))
    got = kernel.run(*feeds.values())
    dtype = case.get("dtype", F32)
    check = verify(got, reference(g, node, feeds), RECIPE_TOLERANCE[dtype])
    assert check.ok, check.report


def test_u32_and_i32_index_regions_are_different_kernels(numba_synth):
    # Why: per-operand dtypes are in the structure key; the kernels read their own index type.
    requests = [request_for(*paged(index=index)[:2]) for index in (DType.U32, DType.I32)]
    answers = [numba_synth.synthesize(r) for r in requests]
    assert all(isinstance(a, Synthesized) for a in answers)
    assert answers[0].entry_point != answers[1].entry_point
    sources = [numba_synth.take_kernel(a.entry_point).source for a in answers]
    assert "uint32[:, ::1]" in sources[0] and "int32[:, ::1]" in sources[1]
    assert "uint32" not in sources[1]


def test_a_matmul_region_is_declined_with_the_reason(numba_synth):
    # Why: fused_linear is not row-wise; the decline must say which op made it so.
    g, node = fused_node(FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(), [[4, 8], [16, 8]],
                         [F32, F32])
    answer = numba_synth.synthesize(request_for(g, node))
    assert isinstance(answer, Declined)
    assert "`matmul` is not a row-wise op" in answer.reason


def test_flash_attention_is_declined_not_approximated(numba_synth):
    g, node = fused_node(FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.5), [[1, 2, 3, 4]] * 3,
                         [F32] * 3)
    answer = numba_synth.synthesize(request_for(g, node))
    assert isinstance(answer, Declined) and "not paged attention" in answer.reason


def test_a_cuda_request_is_declined(numba_synth):
    g, node = fused_node(FusedOps.SILU_MUL, FusedOpParams.SiluMul(), [[2, 8], [2, 8]], [F32, F32])
    answer = numba_synth.synthesize(request_for(g, node, ArchSku.SM90))
    assert answer == Declined("numba builds CPU kernels; the request targets sm90")


def test_compile_budget_is_enforced_on_a_cold_cache(tmp_path):
    # Why: compile time is budgeted; a cold numba compile takes far more than 1 ms.
    g, node = fused_node(FusedOps.SILU_MUL, FusedOpParams.SiluMul(), [[2, 8], [2, 8]], [F32, F32])
    answer = NumbaSynthesizer(tmp_path).synthesize(request_for(g, node, budget=JitBudget(1)))
    assert isinstance(answer, Declined)
    assert answer.reason.startswith("compile budget exceeded: took ")
    assert answer.reason.endswith(" ms > 1 ms")


def test_the_disk_cache_serves_a_second_synthesizer(jit_cache):
    # Why: compiled kernels are cached on disk by structure key; a new process (here: a new
    # synthesizer with the module forgotten) loads instead of compiling.
    import sys

    g, node = fused_node(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), [[2, 24]], [F32])
    request = request_for(g, node)
    first = synthesize_and_take(NumbaSynthesizer(jit_cache), request)
    for name in [n for n in sys.modules if n.endswith(first.entry_point.split(":")[1])]:
        del sys.modules[name]
    second = synthesize_and_take(NumbaSynthesizer(jit_cache), request)
    assert second.from_cache and second.structure_key == first.structure_key
    assert second.source == first.source
    files = list(jit_cache.glob(f"{first.entry_point.split(':')[1]}.py"))
    assert len(files) == 1


def test_take_kernel_hands_the_artifact_over_once(numba_synth):
    g, node = fused_node(FusedOps.SILU_MUL, FusedOpParams.SiluMul(), [[2, 8], [2, 8]], [F32, F32])
    answer = numba_synth.synthesize(request_for(g, node))
    assert numba_synth.take_kernel(answer.entry_point) is not None
    assert numba_synth.take_kernel(answer.entry_point) is None


def test_one_kernel_serves_every_row_count(numba_synth):
    # Why: extents are not in the structure key, so the kernel must be shape-generic.
    g, node = fused_node(FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-5),
                         [[1, 64], [1, 64], [64]], [F32] * 3)
    kernel = synthesize_and_take(numba_synth, request_for(g, node))
    for rows in (1, 7, 300):
        g2, node2 = fused_node(FusedOps.RESIDUAL_ADD_RMS_NORM,
                               FusedOpParams.ResidualAddRmsNorm(1e-5),
                               [[rows, 64], [rows, 64], [64]], [F32] * 3)
        feeds = float_feeds(g2, node2, seed=rows)
        check = verify(kernel.run(*feeds.values()), reference(g2, node2, feeds),
                       RECIPE_TOLERANCE[F32])
        assert check.ok, check.report


def test_kernels_never_use_a_second_thread_pool_and_large_calls_match(numba_synth):
    # Why: numba's parallel layer competes with torch's OpenMP pool for the same cores (a
    # scheduler time slice per hand-over), so every kernel is compiled serial; a large call
    # must still compute every row.
    g, node = fused_node(FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-5), [[1100, 64], [64]],
                         [F32, F32])
    kernel = synthesize_and_take(numba_synth, request_for(g, node))
    assert "parallel=False" in kernel.source and "prange" not in kernel.source
    assert "parallel=True" not in kernel.source
    feeds = float_feeds(g, node)
    x = feeds["in0"]
    assert x.numel() >= 1 << 16
    check = verify(kernel.run(*feeds.values()), reference(g, node, feeds), RECIPE_TOLERANCE[F32])
    assert check.ok, check.report
    assert torch.isfinite(kernel.run(*feeds.values())).all()


def test_a_corrupt_compiled_cache_is_recompiled_not_trusted(tmp_path):
    # Why: a cache written by another numba or a crashed process must never break synthesis.
    import sys

    g, node = fused_node(FusedOps.SILU_MUL, FusedOpParams.SiluMul(), [[2, 8], [2, 8]], [F32, F32])
    request = request_for(g, node)
    first = synthesize_and_take(NumbaSynthesizer(tmp_path), request)
    stem = first.entry_point.split(":")[1]
    for index in (tmp_path / "__pycache__").glob(f"{stem}.*.nbi"):
        index.write_bytes(b"not a numba index")
    for data in (tmp_path / "__pycache__").glob(f"{stem}.*.nbc"):
        data.write_bytes(b"garbage")
    for name in [n for n in sys.modules if n.endswith(stem)]:
        del sys.modules[name]
    second = synthesize_and_take(NumbaSynthesizer(tmp_path), request)
    # The corrupt files were not used: the kernel was compiled afresh (not a cache hit) and
    # the garbage is gone from the cache.
    assert not second.from_cache
    assert not [p for p in (tmp_path / "__pycache__").glob(f"{stem}.*.nb[ic]")
                if p.read_bytes() in (b"garbage", b"not a numba index")]
    feeds = {"a": torch.randn(2, 8), "b": torch.randn(2, 8)}
    torch.testing.assert_close(second.run(*feeds.values()),
                               torch.nn.functional.silu(feeds["a"]) * feeds["b"])
