"""Circuits built straight from the IR dataclasses, for fuser tests that must not depend on
circuit files.

``CircuitBuilder`` wires edges by name: an edge is produced by the node that lists it in
``outs`` and read by every later node that lists it in ``ins``; an edge read before any node
produces it is a circuit input. ``dense(...)`` mirrors the built-in dense_gqa design (node locals
and block names included), ``moe(...)`` the moe_gqa one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fuel.circuit.dims import parse_dim
from fuel.circuit.format import BF16, F32, I32, Format
from fuel.circuit.ir import BlockInstance, Circuit, Edge, LayerKind, Node, Op, OpKind, Section

ROWS = parse_dim("n")


@dataclass
class _PendingNode:
    id: str
    op: Op
    local: str
    block: int
    layer: int | None
    layer_kind: LayerKind | None
    ins: list[str]
    outs: list[str]
    weight: Format | None


@dataclass
class CircuitBuilder:
    arch: str = "toy"
    dims: dict[str, int] = field(default_factory=lambda: {"hidden": 64})
    _blocks: list[dict] = field(default_factory=list)
    _nodes: list[_PendingNode] = field(default_factory=list)
    _formats: dict[str, Format] = field(default_factory=dict)
    _outputs: set[str] = field(default_factory=set)

    def block(self, name: str, section: Section = Section.MAIN, layer: int | None = None,
              layer_kind: LayerKind | None = None) -> CircuitBuilder:
        self._blocks.append(dict(name=name, section=section, layer=layer, layer_kind=layer_kind,
                                 first=len(self._nodes)))
        return self

    def node(self, local: str, kind: OpKind, ins: list[str], outs: list[str], role: str | None = None,
             fmt: Format | None = None, weight: Format | None = None,
             out_format: Format | None = None) -> CircuitBuilder:
        blk = self._blocks[-1]
        layer = blk["layer"]
        if blk["section"] is Section.DRAFT:
            node_id = f"draft.{blk['name']}.{local}"
        elif layer is not None:
            node_id = f"l{layer}.{blk['name']}.{local}"
        else:
            node_id = f"{blk['name']}.{local}"
        self._nodes.append(_PendingNode(node_id, Op(kind, role, fmt), local, len(self._blocks) - 1,
                                        layer, blk["layer_kind"], list(ins), list(outs), weight))
        for out in outs:
            self._formats[out] = out_format or (fmt if kind is OpKind.ACT_QUANT else BF16)
        return self

    def output(self, *edges: str) -> CircuitBuilder:
        self._outputs.update(edges)
        return self

    def edge_format(self, edge: str, fmt: Format) -> CircuitBuilder:
        self._formats[edge] = fmt
        return self

    def build(self) -> Circuit:
        edge_ids: list[str] = []
        producer: dict[str, int | None] = {}
        consumers: dict[str, list[int]] = {}
        for i, node in enumerate(self._nodes):
            for name in node.ins:
                if name not in producer:
                    producer[name] = None
                    edge_ids.append(name)
                consumers.setdefault(name, []).append(i)
            for name in node.outs:
                assert name not in producer, f"edge {name} produced twice"
                producer[name] = i
                edge_ids.append(name)
        index = {name: i for i, name in enumerate(edge_ids)}
        edges = tuple(Edge(id=name, format=self._formats.get(name, I32 if producer[name] is None else BF16),
                           rows=ROWS, dim=parse_dim("hidden"), dim_value=self.dims["hidden"],
                           producer=producer[name], consumers=tuple(consumers.get(name, ())),
                           is_output=name in self._outputs)
                      for name in edge_ids)
        nodes = tuple(Node(id=p.id, op=p.op, local=p.local, block=p.block, layer=p.layer,
                           layer_kind=p.layer_kind, inputs=tuple(index[e] for e in p.ins),
                           outputs=tuple(index[e] for e in p.outs), weight_format=p.weight)
                      for p in self._nodes)
        blocks = []
        for b, blk in enumerate(self._blocks):
            end = self._blocks[b + 1]["first"] if b + 1 < len(self._blocks) else len(self._nodes)
            blocks.append(BlockInstance(blk["name"], blk["section"], blk["layer"], blk["layer_kind"],
                                        blk["first"], end))
        return Circuit(arch=self.arch, nodes=nodes, edges=edges, blocks=tuple(blocks), dims=dict(self.dims))


def _attn(b: CircuitBuilder, prefix: str, stream: str, qk_norm: bool = False) -> str:
    p = prefix
    b.node("attn_norm", OpKind.RMS_NORM, [stream], [f"{p}.attn_norm.out"], weight=BF16)
    for role in ("q", "k", "v"):
        b.node(role, OpKind.LINEAR, [f"{p}.attn_norm.out"], [f"{p}.{role}.out"], role=role, weight=BF16)
    q, k = f"{p}.q.out", f"{p}.k.out"
    if qk_norm:
        b.node("q_norm", OpKind.QK_NORM, [q], [f"{p}.q_norm.out"], weight=BF16)
        b.node("k_norm", OpKind.QK_NORM, [k], [f"{p}.k_norm.out"], weight=BF16)
        q, k = f"{p}.q_norm.out", f"{p}.k_norm.out"
    b.node("rope", OpKind.ROPE, [q, k], [f"{p}.q_rot", f"{p}.k_rot"])
    b.node("kv_write", OpKind.KV_WRITE, [f"{p}.k_rot", f"{p}.v.out"], [])
    b.node("attn", OpKind.PAGED_ATTENTION, [f"{p}.q_rot", f"{p}.k_rot", f"{p}.v.out"], [f"{p}.attn.out"])
    b.node("o", OpKind.LINEAR, [f"{p}.attn.out"], [f"{p}.o.out"], role="o", weight=BF16)
    b.node("attn_residual", OpKind.RESIDUAL_ADD, [stream, f"{p}.o.out"], [f"{p}.attn_residual.out"])
    return f"{p}.attn_residual.out"


def _mlp(b: CircuitBuilder, prefix: str, stream: str) -> str:
    p = prefix
    b.node("mlp_norm", OpKind.RMS_NORM, [stream], [f"{p}.mlp_norm.out"], weight=BF16)
    b.node("gate_up", OpKind.LINEAR, [f"{p}.mlp_norm.out"], [f"{p}.gate_up.out"], role="gate_up", weight=BF16)
    b.node("act", OpKind.SILU_MUL, [f"{p}.gate_up.out"], [f"{p}.act.out"])
    b.node("down", OpKind.LINEAR, [f"{p}.act.out"], [f"{p}.down.out"], role="down", weight=BF16)
    b.node("mlp_residual", OpKind.RESIDUAL_ADD, [stream, f"{p}.down.out"], [f"{p}.mlp_residual.out"])
    return f"{p}.mlp_residual.out"


def _moe(b: CircuitBuilder, prefix: str, stream: str) -> str:
    p = prefix
    b.node("moe_norm", OpKind.RMS_NORM, [stream], [f"{p}.moe_norm.out"], weight=BF16)
    b.node("router", OpKind.ROUTER, [f"{p}.moe_norm.out"], [f"{p}.router.out"], weight=BF16)
    b.node("top_k", OpKind.TOP_K, [f"{p}.router.out"], [f"{p}.top_k.out"])
    b.node("experts_gate_up", OpKind.EXPERT_GATE_UP, [f"{p}.moe_norm.out", f"{p}.top_k.out"],
           [f"{p}.experts_gate_up.out"], weight=BF16)
    b.node("act", OpKind.SILU_MUL, [f"{p}.experts_gate_up.out"], [f"{p}.act.out"])
    b.node("experts_down", OpKind.EXPERT_DOWN, [f"{p}.act.out", f"{p}.top_k.out"],
           [f"{p}.experts_down.out"], weight=BF16)
    b.node("blend", OpKind.BLEND, [f"{p}.experts_down.out", f"{p}.top_k.out"], [f"{p}.blend.out"])
    b.node("moe_residual", OpKind.RESIDUAL_ADD, [stream, f"{p}.blend.out"], [f"{p}.moe_residual.out"])
    return f"{p}.moe_residual.out"


def _head(b: CircuitBuilder, prefix: str, stream: str) -> None:
    p = prefix
    b.node("final_norm", OpKind.FINAL_NORM, [stream], [f"{p}.final_norm.out"], weight=BF16)
    b.node("lm_head", OpKind.LM_HEAD, [f"{p}.final_norm.out"], [f"{p}.logits"],
           weight=BF16, out_format=F32)
    b.node("argmax", OpKind.ARGMAX, [f"{p}.logits"], [f"{p}.tokens"], out_format=I32)
    b.output(f"{p}.logits", f"{p}.tokens")


def dense(layers: int = 2, draft: bool = False, qk_norm: bool = False, arch: str = "dense_gqa",
          moe_layers: frozenset[int] = frozenset()) -> Circuit:
    """A dense (or, for layers in ``moe_layers``, MoE) GQA circuit following the built-in
    design; with ``draft``, an early-exit draft section (embed, attn, mlp, head)."""
    b = CircuitBuilder(arch=arch)
    b.block("embed").node("embed", OpKind.EMBED, [], ["embed.out"], weight=BF16)
    stream = "embed.out"
    for i in range(layers):
        kind = LayerKind.MOE if i in moe_layers else LayerKind.FULL_ATTENTION
        b.block("attn", layer=i, layer_kind=kind)
        stream = _attn(b, f"l{i}.attn", stream, qk_norm)
        if i in moe_layers:
            b.block("moe", layer=i, layer_kind=kind)
            stream = _moe(b, f"l{i}.moe", stream)
        else:
            b.block("mlp", layer=i, layer_kind=kind)
            stream = _mlp(b, f"l{i}.mlp", stream)
    b.block("head")
    _head(b, "head", stream)
    if draft:
        b.block("embed", Section.DRAFT).node("embed", OpKind.EMBED, [], ["draft.embed.out"],
                                             weight=BF16)
        b.block("attn", Section.DRAFT)
        s = _attn(b, "draft.attn", "draft.embed.out", qk_norm)
        b.block("mlp", Section.DRAFT)
        s = _mlp(b, "draft.mlp", s)
        b.block("head", Section.DRAFT)
        _head(b, "draft.head", s)
    return b.build()


def moe(layers: int = 2) -> Circuit:
    return dense(layers, arch="moe_gqa", moe_layers=frozenset(range(layers)))


# ---------------------------------------------------------------- rule files from dicts

ALL_MODES = ["draft", "decode", "multi_seq", "verify", "verify_batch", "prefill"]


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def rule(id: str, pattern: list[dict] | str, **fields) -> dict:
    """A valid rule dict: ``pattern`` may be a bare op name; every field can be overridden and
    a field set to ``None`` is dropped."""
    if isinstance(pattern, str):
        pattern = [{"op": pattern}]
    out = {"id": id, "pattern": pattern,
           "kernels": [{"module": "k", "func": id.replace(".", "_")}],
           "repeat": "once", "emitter": id, "rows": [1, 1024], "modes": ALL_MODES,
           "numerics": "reference", "priority": 0, "cite": f"test rule {id}"}
    out.update(fields)
    return {k: v for k, v in out.items() if v is not None}


def rules_toml(*rules: dict, schema: int = 1) -> str:
    parts = [f"schema = {schema}\n"]
    for r in rules:
        parts.append("\n[[rule]]\n")
        runs = r.get("run", [])
        for key, value in r.items():
            if key != "run":
                parts.append(f"{key} = {_toml_value(value)}\n")
        for select in runs:
            parts.append("[[rule.run]]\n")
            for key, value in select.items():
                parts.append(f"{key} = {_toml_value(value)}\n")
    return "".join(parts)


def make_rules(*rules: dict):
    from fuel.circuit.rules import parse_rules

    return parse_rules(rules_toml(*rules), "test.toml")


def singles(ops=None, **fields) -> list[dict]:
    """Single-op default rules for every op of the closed set (or ``ops``)."""
    kinds = ops or [k.value for k in OpKind]
    return [rule(f"single.{op}", op, **fields) for op in kinds]
