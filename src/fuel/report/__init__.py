"""Plan reports (SPEC §G): what a model does on a device.

The pipeline: :func:`build_report` turns a circuit, a device, the device's rule set and a
policy into one JSON document (documented by ``plan_report.schema.json``, :func:`load_schema`);
:func:`render_text` and :func:`render_html` render that document. The cost model lives in
:mod:`fuel.report.roofline` (circuit-level FLOPs and bytes per op), the memory fit in
:mod:`fuel.report.memory`, the covering fuse, gaps and coverage matrix in
:mod:`fuel.report.coverage`, and the gaps' JIT requests in :mod:`fuel.report.jit`.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from fuel.report.build import (DeviceInfo, ReportOptions, RuleChoice, build_report, device_info,
                               kv_format_for, rule_set_for)
from fuel.report.coverage import (CoverageCell, GapSite, Tier, coverage_matrix, covering_fuse,
                                  gaps_of, novel_rules)
from fuel.report.html import render_html
from fuel.report.memory import MemoryFit, memory_fit, stored_weight_bytes
from fuel.report.roofline import (DeviceRates, NodeWork, StepEstimate, Workload,
                                  decode_weight_bytes, estimate_step, kv_bytes_per_token,
                                  node_work, weight_floor_ns)
from fuel.report.text import render_text


def load_schema(name: str = "plan_report") -> dict[str, Any]:
    """A JSON Schema the CLI's documents validate against: ``plan_report`` (``fuel plan
    --json``) or ``explain`` (``fuel explain --json``)."""
    return json.loads((resources.files("fuel.report") / f"{name}.schema.json").read_text())


__all__ = [
    "CoverageCell", "DeviceInfo", "DeviceRates", "GapSite", "MemoryFit", "NodeWork",
    "ReportOptions", "RuleChoice", "StepEstimate", "Tier", "Workload", "build_report",
    "coverage_matrix", "covering_fuse", "decode_weight_bytes", "device_info", "estimate_step",
    "gaps_of", "kv_bytes_per_token", "kv_format_for", "load_schema", "memory_fit", "node_work",
    "novel_rules", "render_html", "render_text", "rule_set_for", "stored_weight_bytes",
    "weight_floor_ns",
]
