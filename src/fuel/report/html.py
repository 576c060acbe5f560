"""The plan report as one self-contained HTML page: tables and three inline-SVG charts.

Decides the page's layout and draws the charts in Python from the report's JSON document (so the
page shows exactly what ``--json`` says): a stacked bar of step time by op per case, the roofline
of the plan's groups (arithmetic intensity vs attainable FLOP/s, log-log, the device's roofs),
and the memory-fit chart (GiB needed vs concurrency per context, against usable memory).

Invariants: the page loads nothing (no network, no CDN, no fonts): CSS, SVG and one small script
are inline; every text from the report is HTML-escaped; the same document renders byte for byte
the same page. The script only marks ``<body data-rendered="true" data-charts=N>`` once every
chart's SVG has a non-empty box, so a headless browser can assert that the charts rendered.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

GIB = 2**30

# Colour-blind-friendly palette (Okabe-Ito, then Tableau 10); op colours are assigned in a
# fixed order of op names so the same op has the same colour in every chart.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
           "#000000", "#4E79A7", "#F28E2B", "#59A14F", "#B07AA1", "#9C755F", "#BAB0AC",
           "#EDC948", "#76B7B2", "#FF9DA7", "#E15759")

_CSS = """
body{font:14px/1.45 -apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px;color:#1b1b1b;
background:#fff;max-width:1320px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#555;margin:0 0 12px}table{border-collapse:collapse;margin:6px 0 12px}
th,td{border:1px solid #d5d5d5;padding:3px 8px;text-align:right;font-variant-numeric:tabular-nums}
th{background:#f3f3f3}td.l,th.l{text-align:left}.ok{background:#e5f5e0}.bad{background:#fde0dd}
.warn{background:#fff3cd}ul.notes{color:#444;margin:4px 0 12px}svg.chart{display:block;
margin:8px 0 16px;border:1px solid #e3e3e3;background:#fcfcfc}details{margin:4px 0}
code{font-size:12px}
"""

_SCRIPT = """
(function(){
  var charts = document.querySelectorAll('svg.chart');
  var drawn = 0;
  charts.forEach(function(svg){
    var box = svg.getBoundingClientRect();
    var marks = svg.querySelectorAll('rect.mark,circle.mark,polyline.mark');
    var inked = 0;
    marks.forEach(function(m){ var b = m.getBBox(); if (b.width > 0 || b.height > 0) inked++; });
    if (box.width > 0 && box.height > 0 && inked > 0) drawn++;
  });
  document.body.setAttribute('data-charts', String(drawn));
  document.body.setAttribute('data-rendered', drawn === charts.length && drawn > 0 ? 'true' : 'false');
})();
"""


def render_html(doc: Mapping[str, Any]) -> str:
    """The page for a report document (the ``--json`` dict)."""
    model, device, rules = doc["model"], doc["device"], doc["rule_set"]
    ops = _op_order(doc["roofline"])
    colours = {op: PALETTE[i % len(PALETTE)] for i, op in enumerate(ops)}
    title = f"{model['name']} on {device['title']}"
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">",
        f"<title>fuel plan: {escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>fuel plan: {escape(title)}</h1>",
        f"<p class=\"sub\">arch <code>{escape(model['arch'])}</code>, {model['layers']} layers, "
        f"weights {escape(str(model['weight_format']))}; rule set "
        f"<b>{escape(str(rules['name']))}</b>: {escape(rules['reason'])}</p>",
        _assumptions(doc),
        "<h2>Roofline per case</h2>", _cases_table(doc),
        "<h2>Step time by op</h2>", _stacked_bars(doc["roofline"], ops, colours),
        "<h2>Roofline of the plan's groups</h2>", _roofline_chart(doc),
        "<h2>Memory fit</h2>", _memory_chart(doc["memory_fit"]), _memory_table(doc["memory_fit"]),
        "<h2>Coverage matrix</h2>", _coverage_table(doc["coverage"]), _serve(doc["serve"]),
        "<h2>Gaps and JIT requests</h2>", _gaps_table(doc["gaps"]),
        "<h2>Fused plans</h2>", _plans(doc["plans"]),
        _parallel(doc),
        f"<script>{_SCRIPT}</script></body></html>",
    ]
    return "\n".join(parts) + "\n"


def _parallel(doc: Mapping[str, Any]) -> str:
    if "parallel" not in doc:
        return ""
    from fuel.report.parallel_render import render_parallel_html

    return render_parallel_html(doc["parallel"], _table)


# --- formatting helpers -------------------------------------------------------------------------

def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f}"


def _num(x: float) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1,
           classes: Sequence[str] | None = None) -> str:
    th = "".join(f"<th class=\"l\">{escape(h)}</th>" if i < left else f"<th>{escape(h)}</th>"
                 for i, h in enumerate(head))
    body = []
    for r, row in enumerate(rows):
        cls = f" class=\"{classes[r]}\"" if classes and classes[r] else ""
        tds = "".join(f"<td class=\"l\">{c}</td>" if i < left else f"<td>{c}</td>"
                      for i, c in enumerate(row))
        body.append(f"<tr{cls}>{tds}</tr>")
    return f"<table><tr>{th}</tr>{''.join(body)}</table>"


def _op_order(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for case in cases:
        for op in case["time_by_op"]:
            seen.setdefault(op, None)
    return sorted(seen)


def _assumptions(doc: Mapping[str, Any]) -> str:
    a, floor = doc["assumptions"], doc["weight_floor"]
    notes = "".join(f"<li>{escape(n)}</li>" for n in a["notes"])
    return (f"<p>Context {a['context']} tokens per sequence, KV cache {escape(a['kv_format'])}. "
            f"Weight floor: {_gib(floor['weight_bytes'])} GiB of weights read per decode step → "
            f"<b>{_ms(floor['ns'])} ms</b> ({_num(floor['tokens_per_s'])} tokens/s at C=1)."
            f"</p><ul class=\"notes\">{notes}</ul>")


def _cases_table(doc: Mapping[str, Any]) -> str:
    rows = []
    classes = []
    for c in doc["roofline"]:
        rows.append([escape(c["name"]), str(c["rows"]), _ms(c["ceiling_ns"]),
                     _ms(c["with_launch_ns"]), str(c["launches"]),
                     _num(c["tokens_per_s_ceiling"]), _num(c["tokens_per_s_with_launch"]),
                     _gib(c["weight_bytes"]), _gib(c["kv_bytes"])])
        classes.append("" if c["planned"] else "warn")
    return _table(["case", "rows", "ceiling ms", "+launch ms", "launches", "tok/s ceiling",
                   "tok/s +launch", "weights GiB", "KV GiB"], rows, classes=classes)


# --- charts --------------------------------------------------------------------------------------

def _svg(width: int, height: int, label: str, body: Sequence[str]) -> str:
    return (f"<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" "
            f"height=\"{height}\" viewBox=\"0 0 {width} {height}\" role=\"img\" "
            f"aria-label=\"{escape(label)}\">" + "".join(body) + "</svg>")


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 12,
          extra: str = "") -> str:
    return (f"<text x=\"{x:.1f}\" y=\"{y:.1f}\" font-size=\"{size}\" text-anchor=\"{anchor}\" "
            f"font-family=\"Helvetica,Arial,sans-serif\"{extra}>{escape(s)}</text>")


def _stacked_bars(cases: Sequence[Mapping[str, Any]], ops: Sequence[str],
                  colours: Mapping[str, str]) -> str:
    """One horizontal bar per case, 100% = the case's ceiling step time, split by op."""
    left, top, bar_w, bar_h, gap = 190, 20, 760, 26, 12
    legend_x = left + bar_w + 30
    height = max(top + len(cases) * (bar_h + gap) + 40, top + 18 * len(ops) + 20)
    body = []
    for i, case in enumerate(cases):
        y = top + i * (bar_h + gap)
        total = sum(case["time_by_op"].values()) or 1.0
        body.append(_text(left - 8, y + bar_h * 0.68, f"{case['name']} ({_ms(total)} ms)", "end"))
        x = float(left)
        for op in ops:
            ns = case["time_by_op"].get(op, 0.0)
            if ns <= 0:
                continue
            w = bar_w * ns / total
            body.append(f"<rect class=\"mark\" x=\"{x:.2f}\" y=\"{y}\" width=\"{w:.2f}\" "
                        f"height=\"{bar_h}\" fill=\"{colours[op]}\"><title>{escape(case['name'])}"
                        f": {escape(op)} {_ms(ns)} ms ({100 * ns / total:.1f}%)</title></rect>")
            x += w
    axis_y = top + len(cases) * (bar_h + gap)
    for pct in (0, 25, 50, 75, 100):
        x = left + bar_w * pct / 100
        body.append(f"<line x1=\"{x:.1f}\" y1=\"{top - 4}\" x2=\"{x:.1f}\" y2=\"{axis_y}\" "
                    "stroke=\"#bbb\" stroke-dasharray=\"2,3\"/>")
        body.append(_text(x, axis_y + 14, f"{pct}%", "middle", 11))
    for j, op in enumerate(ops):
        y = top + j * 18
        body.append(f"<rect x=\"{legend_x}\" y=\"{y}\" width=\"12\" height=\"12\" "
                    f"fill=\"{colours[op]}\"/>")
        body.append(_text(legend_x + 18, y + 10, op, "start", 11))
    return _svg(legend_x + 200, height, "share of step time by op per case", body)


def _roofline_chart(doc: Mapping[str, Any]) -> str:
    """Log-log: x = FLOP per byte, y = attainable FLOP/s. Roofs: bandwidth x intensity up to
    each tensor peak. Points: each case's sites at their roofline FLOP/s."""
    device = doc["device"]
    bw = device["bandwidth_bytes_per_s"]
    peaks = {k: v for k, v in device["peak_flops_per_s"].items() if v and v > 0}
    left, top, w, h = 80, 20, 820, 420
    x_lo, x_hi = -2.0, 5.0
    points = []
    for ci, case in enumerate(doc["roofline"]):
        for s in case["sites"]:
            if s["bytes"] <= 0 or s["flops"] <= 0 or s["ns"] <= 0:
                continue
            points.append((ci, case["name"], s, s["flops"] / s["bytes"], s["flops"] / s["ns"] * 1e9))
    top_rate = max(list(peaks.values()) + [p[4] for p in points] + [1.0])
    y_hi = math.ceil(math.log10(top_rate) + 0.2)
    y_lo = y_hi - 7
    if points:
        x_lo = min(x_lo, math.floor(math.log10(min(p[3] for p in points))))
        x_hi = max(x_hi, math.ceil(math.log10(max(p[3] for p in points))))

    def px(intensity: float) -> float:
        return left + w * (math.log10(intensity) - x_lo) / (x_hi - x_lo)

    def py(rate: float) -> float:
        v = min(max(math.log10(rate), y_lo), y_hi)
        return top + h * (1 - (v - y_lo) / (y_hi - y_lo))

    body = [f"<rect x=\"{left}\" y=\"{top}\" width=\"{w}\" height=\"{h}\" fill=\"#fff\" "
            "stroke=\"#999\"/>"]
    for e in range(int(x_lo), int(x_hi) + 1):
        x = px(10.0 ** e)
        body.append(f"<line x1=\"{x:.1f}\" y1=\"{top}\" x2=\"{x:.1f}\" y2=\"{top + h}\" "
                    "stroke=\"#eee\"/>")
        body.append(_text(x, top + h + 16, f"1e{e}", "middle", 11))
    for e in range(y_lo, y_hi + 1):
        y = py(10.0 ** e)
        body.append(f"<line x1=\"{left}\" y1=\"{y:.1f}\" x2=\"{left + w}\" y2=\"{y:.1f}\" "
                    "stroke=\"#eee\"/>")
        body.append(_text(left - 6, y + 4, f"1e{e}", "end", 11))
    body.append(_text(left + w / 2, top + h + 34, "arithmetic intensity (FLOP / byte)", "middle"))
    body.append(_text(18, top + h / 2, "attainable FLOP/s", "middle", 12,
                      f" transform=\"rotate(-90 18 {top + h / 2:.1f})\""))
    roof_colours = {"bf16": "#0072B2", "fp8": "#D55E00", "fp4": "#009E73", "fp32": "#777777"}
    for name, peak in sorted(peaks.items(), key=lambda kv: kv[1]):
        ridge = peak / bw
        xs = [10.0 ** x_lo, ridge, 10.0 ** x_hi]
        pts = " ".join(f"{px(x):.1f},{py(min(peak, bw * x)):.1f}" for x in xs)
        colour = roof_colours.get(name, "#555")
        body.append(f"<polyline class=\"mark\" points=\"{pts}\" fill=\"none\" stroke=\"{colour}\" "
                    f"stroke-width=\"2\"><title>{escape(name)} roof: {peak:.3g} FLOP/s, ridge "
                    f"{ridge:.1f} FLOP/B</title></polyline>")
        body.append(_text(left + w - 4, py(peak) - 4, f"{name} {peak / 1e12:.0f} TFLOP/s",
                          "end", 11, f" fill=\"{colour}\""))
    case_colours = PALETTE
    for ci, cname, s, intensity, rate in points:
        label = f"{cname}: {s['block']} [{', '.join(s['locals'])}] rule={s['rule']} " \
                f"x{s['count']}: {intensity:.2f} FLOP/B, {rate:.3g} FLOP/s"
        body.append(f"<circle class=\"mark\" cx=\"{px(intensity):.1f}\" cy=\"{py(rate):.1f}\" "
                    f"r=\"4\" fill=\"{case_colours[ci % len(case_colours)]}\" fill-opacity=\"0.7\">"
                    f"<title>{escape(label)}</title></circle>")
    for ci, case in enumerate(doc["roofline"]):
        y = top + 14 + ci * 16
        body.append(f"<circle cx=\"{left + 14}\" cy=\"{y - 4}\" r=\"4\" "
                    f"fill=\"{case_colours[ci % len(case_colours)]}\"/>")
        body.append(_text(left + 24, y, case["name"], "start", 11))
    return _svg(left + w + 20, top + h + 48, "roofline of the plan's groups", body)


def _memory_chart(fit: Mapping[str, Any]) -> str:
    """GiB needed vs concurrency (log2 axis) per context; usable memory and weights as lines."""
    left, top, w, h = 80, 20, 820, 320
    cells = fit["cells"]
    concurrencies = sorted({c["concurrency"] for c in cells})
    contexts = sorted({c["context"] for c in cells})
    y_max = max([c["need_bytes"] for c in cells] + [fit["usable_bytes"], fit["device_bytes"]]) * 1.05
    lo, hi = math.log2(concurrencies[0]), math.log2(concurrencies[-1]) or 1.0

    def px(c: int) -> float:
        return left + w * (math.log2(c) - lo) / ((hi - lo) or 1.0)

    def py(b: float) -> float:
        return top + h * (1 - b / y_max)

    body = [f"<rect x=\"{left}\" y=\"{top}\" width=\"{w}\" height=\"{h}\" fill=\"#fff\" "
            "stroke=\"#999\"/>"]
    for c in concurrencies:
        body.append(_text(px(c), top + h + 16, str(c), "middle", 11))
    step = _nice_step(y_max / GIB)
    g = 0.0
    while g <= y_max / GIB:
        y = py(g * GIB)
        body.append(f"<line x1=\"{left}\" y1=\"{y:.1f}\" x2=\"{left + w}\" y2=\"{y:.1f}\" "
                    "stroke=\"#eee\"/>")
        body.append(_text(left - 6, y + 4, f"{g:g}", "end", 11))
        g += step
    body.append(_text(left + w / 2, top + h + 34, "concurrent sequences (C)", "middle"))
    body.append(_text(18, top + h / 2, "GiB", "middle", 12,
                      f" transform=\"rotate(-90 18 {top + h / 2:.1f})\""))
    usable_y = py(fit["usable_bytes"])
    body.append(f"<line x1=\"{left}\" y1=\"{usable_y:.1f}\" x2=\"{left + w}\" y2=\"{usable_y:.1f}\" "
                "stroke=\"#D55E00\" stroke-width=\"2\" stroke-dasharray=\"6,4\"/>")
    body.append(_text(left + w - 4, usable_y - 5,
                      f"usable {_gib(fit['usable_bytes'])} GiB (90% of device)", "end", 11,
                      " fill=\"#D55E00\""))
    weights_y = py(fit["weight_bytes"])
    body.append(f"<line x1=\"{left}\" y1=\"{weights_y:.1f}\" x2=\"{left + w}\" "
                f"y2=\"{weights_y:.1f}\" stroke=\"#777\" stroke-dasharray=\"2,3\"/>")
    body.append(_text(left + 6, weights_y - 5, f"weights {_gib(fit['weight_bytes'])} GiB",
                      "start", 11, " fill=\"#555\""))
    for k, ctx in enumerate(contexts):
        colour = PALETTE[k % len(PALETTE)]
        row = sorted((c for c in cells if c["context"] == ctx), key=lambda c: c["concurrency"])
        pts = " ".join(f"{px(c['concurrency']):.1f},{py(c['need_bytes']):.1f}" for c in row)
        body.append(f"<polyline class=\"mark\" points=\"{pts}\" fill=\"none\" stroke=\"{colour}\" "
                    "stroke-width=\"2\"/>")
        for c in row:
            fill = colour if c["fits"] else "#fff"
            body.append(f"<circle class=\"mark\" cx=\"{px(c['concurrency']):.1f}\" "
                        f"cy=\"{py(c['need_bytes']):.1f}\" r=\"4\" fill=\"{fill}\" "
                        f"stroke=\"{colour}\" stroke-width=\"2\"><title>context {ctx}, C="
                        f"{c['concurrency']}: {_gib(c['need_bytes'])} GiB "
                        f"{'fits' if c['fits'] else 'short ' + _gib(c['shortfall_bytes']) + ' GiB'}"
                        "</title></circle>")
        body.append(f"<rect x=\"{left + 14}\" y=\"{top + 10 + 16 * k}\" width=\"12\" height=\"3\" "
                    f"fill=\"{colour}\"/>")
        body.append(_text(left + 32, top + 15 + 16 * k, f"context {ctx} (hollow = does not fit)",
                          "start", 11))
    return _svg(left + w + 20, top + h + 48, "memory fit", body)


def _nice_step(span: float) -> float:
    raw = span / 6 or 1.0
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


# --- tables --------------------------------------------------------------------------------------

def _memory_table(fit: Mapping[str, Any]) -> str:
    contexts = sorted({c["context"] for c in fit["cells"]})
    concurrencies = sorted({c["concurrency"] for c in fit["cells"]})
    by = {(c["context"], c["concurrency"]): c for c in fit["cells"]}
    rows = []
    for ctx in contexts:
        row = [f"context {ctx}"]
        for c in concurrencies:
            cell = by[(ctx, c)]
            row.append("fits" if cell["fits"] else f"short {_gib(cell['shortfall_bytes'])} GiB")
        rows.append(row)
    head = ["", *[f"C={c}" for c in concurrencies]]
    return (f"<p>Weights {_gib(fit['weight_bytes'])} GiB; KV {fit['kv_bytes_per_token']:,} bytes per "
            f"token ({escape(fit['kv_format'])}); usable {_gib(fit['usable_bytes'])} of "
            f"{_gib(fit['device_bytes'])} GiB.</p>" + _table(head, rows))


def _coverage_table(cells: Sequence[Mapping[str, Any]]) -> str:
    rows, classes = [], []
    for c in cells:
        status = f"planned, {c['launches']} launches" if c["planned"] else \
            escape(c["reason"] or "not planned")
        rows.append([escape(c["mode"]), escape(c["tier"]), str(c["rows"]), status])
        classes.append("ok" if c["planned"] else "bad")
    return _table(["mode", "tier", "rows", "planned (launches) or why not"], rows, left=4,
                  classes=classes)


def _serve(serve: Mapping[str, Sequence[str]]) -> str:
    if not serve:
        return "<p>No modes requested with <code>--serve</code>.</p>"
    items = []
    for mode, missing in serve.items():
        items.append(f"<li>{escape(mode)}: " + ("servable at every tier" if not missing else
                     "<b>no plan</b> at " + escape(", ".join(missing))) + "</li>")
    return f"<ul>{''.join(items)}</ul>"


def _gaps_table(gaps: Sequence[Mapping[str, Any]]) -> str:
    if not gaps:
        return "<p>Every op is covered by a rule on this device.</p>"
    rows = []
    for g in gaps:
        req = g["request"]
        if req["status"] == "request":
            ops = "; ".join(f"{o['dtype']}{o['shape']}" for o in req.get("operands", []))
            what = f"request <code>{escape(req.get('fused_op', '?'))}</code> on " \
                   f"{escape(req.get('backend', '?'))}: {escape(ops)}"
        else:
            what = "declined: " + escape(req.get("reason", ""))
        rows.append([escape(g["op"]), escape(g["block"]), escape(g["local"]),
                     escape(", ".join(g["modes"])), str(g["count"]),
                     f"{100 * g['share_of_step']:.1f}%", what])
    return _table(["op", "block", "local", "modes", "count", "share of step", "JIT request"],
                  rows, left=4)


def _plans(plans: Sequence[Mapping[str, Any]]) -> str:
    rows = [[escape(p["mode"]), str(p["rows"]), escape(p["table"] or ""),
             f"<code>{p['digest'][:16]}</code>", str(p["groups"]), str(p["launches"]),
             str(p["copies"]), str(p["fused_edges"]), str(p["materialized_edges"]),
             str(p["novel_groups"])] for p in plans]
    out = [_table(["mode", "rows", "table", "digest", "groups", "launches", "copies", "fused",
                   "materialized", "novel"], rows, left=3)]
    for p in plans:
        site_rows = [[escape(s["block"]), escape(" + ".join(s["locals"])),
                      escape(", ".join(s["kernels"]) or "(host)"), escape(s["rule"]),
                      str(s["count"])] for s in p["sites"]]
        label = f"{p['mode']} rows={p['rows']}" + (f" table={p['table']}" if p["table"] else "")
        out.append(f"<details><summary>{escape(label)}: by site</summary>"
                   + _table(["block", "locals", "kernels", "rule", "count"], site_rows, left=4)
                   + "</details>")
    return "".join(out)
