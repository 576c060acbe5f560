"""Measuring workloads through the CPU binding table into the Judge store."""

from fuel.cost import JudgeOracle, JudgeStore
from fuel.cost.campaign import Measured, Skipped, measure_workload, run_campaign
from fuel.cost.workloads import ModelDims, Workload, families, workloads
from fuel.graph import DType, FusedOpParams, FusedOps, Graph
from fuel.kernels import cpu_table

TINY = ModelDims(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16)


def test_workloads_cover_every_family_at_several_sizes_in_a_fixed_order():
    items = workloads(TINY)
    assert [w.family for w in items] == sorted([w.family for w in items], key=families().index)
    for family in families():
        assert sum(w.family == family for w in items) >= 3


def test_measurements_land_in_the_store_under_the_shared_key(tmp_path):
    items = [w for w in workloads(TINY) if w.family in ("add", "flash_attn")][:3]
    path = tmp_path / "j.sqlite"
    with JudgeStore.open(path) as store:
        results = run_campaign(items, store, warmup=1, repeats=3, min_sample_ns=1000)
        rows = store.rows()
    assert all(isinstance(r, Measured) for r in results)
    assert {(r.op, r.size_class, r.kernel_source) for r in rows} == {
        ("add", "e6", "torch.cpu"), ("add", "e9", "torch.cpu"), ("add", "e12", "torch.cpu")}
    oracle = JudgeOracle.load(path)
    assert oracle.measured_latency_ns("add", "f32", "e9", "cpu", "torch.cpu") >= 1


def test_a_family_without_a_cpu_kernel_is_skipped_with_the_reason():
    g = Graph()
    q = g.input("q", [1, 4, 1, 16], DType.F32)
    cache = g.input("k", [4, 4, 2, 16], DType.F32)
    node = g.fused(FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(softmax_scale=0.25, block_size=4), q, cache, cache,
                   g.input("bt", [1, 2], DType.U32), g.input("cl", [1], DType.U32))
    result = measure_workload(Workload("paged_attn", "tiny", g, node), cpu_table())
    assert isinstance(result, Skipped) and "paged_attn" in result.reason
