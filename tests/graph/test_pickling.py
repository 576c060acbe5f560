"""Stored programs restore their graph values without ``dataclasses.fields`` (fast_pickle):
equal values, equal hashes, every field kept."""

from __future__ import annotations

import dataclasses
import pickle

from fuel.graph.dtype import DType
from fuel.graph.ir import Graph
from fuel.graph.ops import OpKind
from fuel.graph.registry import FusedOpParams, FusedOps
from fuel.optimize.decisions import ArmRecord, BranchKind, CostSource, Decision, Reason


def test_graph_values_and_decisions_round_trip_equal_without_reading_their_fields(monkeypatch):
    graph = Graph()
    x = graph.input("x", (4, 8), DType.F32)
    gain = graph.weight("g", (8,), DType.F32)
    norm = graph.fused(FusedOps.RMS_NORM, FusedOpParams.RmsNorm(eps=1e-5), x, gain)
    view = graph.prim(OpKind.RESHAPE, norm, shape=(32,))
    decision = Decision(7, BranchKind.VARIANT,
                        (ArmRecord(0, 3, "mul", None, 120, CostSource.JUDGE, None, 40),), 0,
                        Reason.NOT_CHEAPER, 0.25)
    stored = pickle.dumps((graph, decision))

    def unread(*args):
        raise AssertionError("restoring must not walk dataclasses.fields")

    monkeypatch.setattr(dataclasses, "fields", unread)
    restored, again = pickle.loads(stored)
    monkeypatch.undo()
    for node_id in (x, gain, norm, view):
        assert restored.node(node_id) == graph.node(node_id)
        assert hash(restored.node(node_id)) == hash(graph.node(node_id))
    assert again == decision and again.arms[0].dispatch_ns == 40
