"""Per-rank circuits (fuel.circuit.parallel): what each rank of a split holds, where the
collectives go, which splits are refused, and that tp = pp = 1 changes nothing."""

from __future__ import annotations

import pytest

from fuel.circuit import AvailableKernels, build_policy, fuse, instantiate, load_builtin_rules, zoo
from fuel.circuit.ir import OpKind, Section
from fuel.circuit.parallel import Parallel, ParallelError, SplitRefused, rank_circuit, split_shape
from fuel.circuit.rules import Mode

CPU = load_builtin_rules("cpu")
CUDA = load_builtin_rules("cuda")
POLICY = build_policy()


def plan(circuit, rules=CPU, mode=Mode.DECODE, rows=1):
    return fuse(circuit, rules, AvailableKernels.all_named_by(rules), POLICY, mode, rows)


@pytest.fixture(scope="module")
def smollm2():
    return zoo.load("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_tp3(smollm2):
    return [rank_circuit(smollm2, Parallel(tp=3), r) for r in range(3)]


def ops_after(circuit, local):
    """The op of the node that reads the first output of each node with template id ``local``."""
    out = []
    for node in circuit.nodes:
        if node.local == local and node.layer == 0:
            reader = circuit.edges[node.outputs[0]].consumers[0]
            out.append(circuit.nodes[reader].op.kind)
    return out


def test_trivial_layout_is_the_identity(smollm2):
    assert rank_circuit(smollm2, Parallel(), 0) is smollm2
    template = zoo.builtin_circuit(smollm2.arch)
    again = instantiate(template, smollm2.shape, parallel=Parallel(tp=1, pp=1))
    assert plan(again).digest == plan(smollm2).digest
    assert again.rank is None


def test_smollm2_tp3_rank_divides_heads_columns_and_vocabulary(smollm2_tp3):
    dims = smollm2_tp3[1].dims
    assert (dims["q_heads"], dims["kv_heads"], dims["intermediate"], dims["vocab"]) == (3, 1, 512, 16384)
    assert dims["hidden"] == 576  # the residual stream is whole on every rank
    shards = dict(smollm2_tp3[1].rank.shards)
    layer0 = "model.layers.0"
    assert shards[f"{layer0}.self_attn.q_proj.weight"].text() == "dim0[192:384]"
    assert shards[f"{layer0}.self_attn.k_proj.weight"].text() == "dim0[64:128]"
    assert shards[f"{layer0}.self_attn.o_proj.weight"].text() == "dim1[192:384]"
    assert shards[f"{layer0}.mlp.gate_proj.weight"].text() == "dim0[512:1024]"
    assert shards[f"{layer0}.mlp.down_proj.weight"].text() == "dim1[512:1024]"
    assert shards["model.embed_tokens.weight"].text() == "dim0[16384:32768]"
    assert f"{layer0}.input_layernorm.weight" not in shards  # norm gains are replicated


def test_collectives_follow_row_parallel_projections_embedding_and_head(smollm2_tp3):
    circuit = smollm2_tp3[0]
    assert ops_after(circuit, "o") == [OpKind.ALL_REDUCE]
    assert ops_after(circuit, "down") == [OpKind.ALL_REDUCE]
    embed = next(n for n in circuit.nodes if n.id == "embed.embed")
    assert circuit.nodes[circuit.edges[embed.outputs[0]].consumers[0]].op.kind is OpKind.ALL_REDUCE
    gather = next(n for n in circuit.nodes if n.id == "head.lm_head_all_gather")
    logits = circuit.edges[gather.outputs[0]]
    assert (logits.id, logits.dim.text, logits.dim_value, logits.is_output) == (
        "head.logits", "vocab*3", 49152, True)
    kinds = [n.op.kind for n in circuit.nodes if circuit.blocks[n.block].section is Section.MAIN]
    # per layer: attention and MLP reduce; plus the embedding's reduce
    assert kinds.count(OpKind.ALL_REDUCE) == 2 * 30 + 1
    assert kinds.count(OpKind.ALL_GATHER) == 1


def test_each_rank_has_its_own_deterministic_digest(smollm2, smollm2_tp3):
    digests = [plan(c).digest for c in smollm2_tp3]
    assert len(set(digests)) == 3
    assert plan(smollm2).digest not in digests
    assert [plan(rank_circuit(smollm2, Parallel(tp=3), r)).digest for r in range(3)] == digests


def test_rank_plans_fuse_with_the_collectives_claimed_by_rules(smollm2_tp3):
    for rules, prefix in ((CPU, "cpu."), (CUDA, "cuda.")):
        p = plan(smollm2_tp3[0], rules)
        claimed = {g.rule for g in p.groups
                   if smollm2_tp3[0].nodes[g.nodes[0]].op.kind is OpKind.ALL_REDUCE}
        assert claimed == {prefix + "all_reduce"}


def test_tp2_is_refused_for_smollm2_naming_the_heads(smollm2):
    with pytest.raises(SplitRefused) as refused:
        rank_circuit(smollm2, Parallel(tp=2), 0)
    assert refused.value.dim == "q_heads" and refused.value.value == 9
    assert "9 heads do not divide into 2 ranks" in str(refused.value)


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    full = zoo.load("llama-3.1-70b", draft=False)  # 64 heads, 8 KV heads
    ranks = [rank_circuit(full, Parallel(tp=16), r) for r in (0, 1, 2)]
    assert [c.dims["kv_heads"] for c in ranks] == [1, 1, 1]
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [c.rank.shard_of(k).text() for c in ranks] == ["dim0[0:128]", "dim0[0:128]", "dim0[128:256]"]
    with pytest.raises(SplitRefused) as refused:
        split_shape(full.shape, Parallel(tp=3))
    assert refused.value.dim == "q_heads"


def test_pipeline_stages_cut_layers_with_send_and_recv(smollm2):
    with pytest.raises(SplitRefused) as refused:
        split_shape(smollm2.shape, Parallel(pp=4))
    assert refused.value.dim == "layers"
    first, last = (rank_circuit(smollm2, Parallel(pp=2), r) for r in (0, 1))
    assert first.nodes[0].id == "embed.embed" and first.nodes[-1].op.kind is OpKind.SEND
    assert last.nodes[0].op.kind is OpKind.RECV and last.nodes[-1].id == "head.argmax"
    assert {n.layer for n in first.nodes if n.layer is not None} == set(range(15))
    assert {n.layer for n in last.nodes if n.layer is not None} == set(range(15, 30))
    assert not any(b.section is Section.DRAFT for b in first.blocks + last.blocks)
    assert plan(first).digest != plan(last).digest


def test_expert_parallel_splits_experts_and_reduces_over_them():
    full = zoo.load("qwen3-30b-a3b", draft=False)
    rank = rank_circuit(full, Parallel(tp=4, ep=4), 2)
    assert rank.dims["experts"] == 32 and rank.dims["expert_intermediate"] == 768
    stack = "model.layers.0.mlp.experts.*.gate_proj.weight"
    assert rank.rank.shard_of(stack).text() == "dim0[64:96]"
    router = next(n for n in rank.nodes if n.op.kind is OpKind.ROUTER)
    assert rank.edges[router.outputs[0]].dim_value == 128  # every rank routes over all experts
    assert any(n.op.kind is OpKind.EP_REDUCE for n in rank.nodes)
    tensor_split = rank_circuit(full, Parallel(tp=4), 2)
    assert (tensor_split.dims["experts"], tensor_split.dims["expert_intermediate"]) == (128, 192)
    with pytest.raises(ParallelError):
        Parallel(tp=4, ep=2)
