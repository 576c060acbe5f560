"""A small hand-built dense GQA circuit for the report tests, independent of circuit files.

Same block structure and locals as the built-in ``dense_gqa`` circuit (embed; per layer attn and
mlp; head), so the report's cost model sees the ops it sees in real circuits.
"""

from __future__ import annotations

from fuel.circuit.dims import parse_dim
from fuel.circuit.format import BF16, I32, Format
from fuel.circuit.ir import (ArchShape, BlockInstance, Circuit, Edge, LayerKind, Node, Op, OpKind,
                             Section)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.edges: list[dict] = []
        self.blocks: list[BlockInstance] = []
        self.edge_ids: dict[str, int] = {}

    def edge(self, eid: str, dim: int, fmt: Format = BF16, output: bool = False) -> int:
        self.edge_ids[eid] = len(self.edges)
        self.edges.append(dict(id=eid, dim=dim, fmt=fmt, producer=None, consumers=[],
                               output=output))
        return self.edge_ids[eid]

    def node(self, nid: str, op: Op, local: str, ins: list[int], outs: list[int],
             layer: int | None, kind: LayerKind | None, bindings: tuple[str, ...] = (),
             weight: Format | None = None) -> None:
        index = len(self.nodes)
        for e in ins:
            self.edges[e]["consumers"].append(index)
        for e in outs:
            self.edges[e]["producer"] = index
        self.nodes.append(Node(id=nid, op=op, local=local, block=len(self.blocks), layer=layer,
                               layer_kind=kind, inputs=tuple(ins), outputs=tuple(outs),
                               bindings=bindings, weight_format=weight))

    def close_block(self, name: str, first: int, section: Section = Section.MAIN,
                    layer: int | None = None, kind: LayerKind | None = None) -> None:
        self.blocks.append(BlockInstance(name, section, layer, kind, first, len(self.nodes)))


def dense_circuit(layers: int = 2, hidden: int = 64, q_heads: int = 4, kv_heads: int = 2,
                  head_dim: int = 16, intermediate: int = 128, vocab: int = 256,
                  weight: Format = BF16) -> Circuit:
    """``layers`` of attn + mlp between an embed prologue and a head epilogue."""
    b = _Builder()
    w = weight
    x = b.edge("embed.x", hidden)
    b.node("embed.embed", Op(OpKind.EMBED), "embed", [], [x], None, None,
           ("model.embed_tokens.weight",), w)
    b.close_block("embed", 0)
    fa = LayerKind.FULL_ATTENTION
    for i in range(layers):
        L = f"model.layers.{i}"
        first = len(b.nodes)
        p = f"l{i}.attn."
        h = b.edge(p + "h", hidden)
        q, k, v = (b.edge(p + "q_out", q_heads * head_dim), b.edge(p + "k_out", kv_heads * head_dim),
                   b.edge(p + "v_out", kv_heads * head_dim))
        qr, kr = b.edge(p + "q_rot", q_heads * head_dim), b.edge(p + "k_rot", kv_heads * head_dim)
        a, o, x2 = b.edge(p + "attn_out", q_heads * head_dim), b.edge(p + "o_out", hidden), \
            b.edge(p + "x", hidden)
        b.node(p + "attn_norm", Op(OpKind.RMS_NORM), "attn_norm", [x], [h], i, fa,
               (f"{L}.input_layernorm.weight",), w)
        for role, e in (("q", q), ("k", k), ("v", v)):
            b.node(p + role, Op(OpKind.LINEAR, role=role), role, [h], [e], i, fa,
                   (f"{L}.self_attn.{role}_proj.weight",), w)
        b.node(p + "rope", Op(OpKind.ROPE), "rope", [q, k], [qr, kr], i, fa)
        b.node(p + "kv_write", Op(OpKind.KV_WRITE), "kv_write", [kr, v], [], i, fa)
        b.node(p + "attn", Op(OpKind.PAGED_ATTENTION), "attn", [qr, kr, v], [a], i, fa)
        b.node(p + "o", Op(OpKind.LINEAR, role="o"), "o", [a], [o], i, fa,
               (f"{L}.self_attn.o_proj.weight",), w)
        b.node(p + "attn_residual", Op(OpKind.RESIDUAL_ADD), "attn_residual", [x, o], [x2], i, fa)
        b.close_block("attn", first, layer=i, kind=fa)
        first = len(b.nodes)
        p = f"l{i}.mlp."
        h, gu, act, dn, x3 = (b.edge(p + "h", hidden), b.edge(p + "gate_up_out", 2 * intermediate),
                              b.edge(p + "act_out", intermediate), b.edge(p + "down_out", hidden),
                              b.edge(p + "x", hidden))
        b.node(p + "mlp_norm", Op(OpKind.RMS_NORM), "mlp_norm", [x2], [h], i, fa,
               (f"{L}.post_attention_layernorm.weight",), w)
        b.node(p + "gate_up", Op(OpKind.LINEAR, role="gate_up"), "gate_up", [h], [gu], i, fa,
               (f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"), w)
        b.node(p + "act", Op(OpKind.SILU_MUL), "act", [gu], [act], i, fa)
        b.node(p + "down", Op(OpKind.LINEAR, role="down"), "down", [act], [dn], i, fa,
               (f"{L}.mlp.down_proj.weight",), w)
        b.node(p + "mlp_residual", Op(OpKind.RESIDUAL_ADD), "mlp_residual", [x2, dn], [x3], i, fa)
        b.close_block("mlp", first, layer=i, kind=fa)
        x = x3
    first = len(b.nodes)
    hn, logits, tokens = (b.edge("head.h", hidden), b.edge("head.logits", vocab, output=True),
                          b.edge("head.tokens", 1, I32, output=True))
    b.node("head.final_norm", Op(OpKind.FINAL_NORM), "final_norm", [x], [hn], None, None,
           ("model.norm.weight",), w)
    b.node("head.lm_head", Op(OpKind.LM_HEAD), "lm_head", [hn], [logits], None, None,
           ("lm_head.weight",), w)
    b.node("head.argmax", Op(OpKind.ARGMAX), "argmax", [logits], [tokens], None, None)
    b.close_block("head", first)

    rows = parse_dim("n")
    edges = tuple(Edge(id=e["id"], format=e["fmt"], rows=rows, dim=parse_dim(str(e["dim"])),
                       dim_value=e["dim"], producer=e["producer"],
                       consumers=tuple(e["consumers"]), is_output=e["output"])
                  for e in b.edges)
    dims = {"hidden": hidden, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "intermediate": intermediate, "vocab": vocab}
    shape = ArchShape("dense_gqa", "llama", layers, (fa,) * layers, dims, weight_format=w)
    return Circuit("dense_gqa", tuple(b.nodes), edges, tuple(b.blocks), dims, shape)
