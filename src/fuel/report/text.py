"""The plan report as rich terminal text, rendered from the report document (the ``--json``
dict), so the terminal shows exactly what the JSON says.

Decides the order of the sections (device and rule set, assumptions, weight floor, roofline
cases, memory fit, fused plans by site, gaps, coverage matrix, serve verdict) and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

GIB = 2**30


def _ms(ns: float) -> str:
    return f"{ns / 1e6:,.3f}"


def _rate(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def render_text(doc: Mapping[str, Any], console: Console) -> None:
    """Print the report on ``console``."""
    model, device, rules = doc["model"], doc["device"], doc["rule_set"]
    console.print(Text.assemble(("fuel plan ", "bold"), (model["name"], "bold cyan"), " on ",
                                (device["title"], "bold cyan"),
                                f"  ({model['arch']}, {model['layers']} layers, weights "
                                f"{model['weight_format']})"))
    console.print(f"rule set: [bold]{rules['name']}[/] — {rules['reason']}", highlight=False)
    a = doc["assumptions"]
    console.print(f"context {a['context']} tokens/sequence, KV cache {a['kv_format']}; "
                  f"bandwidth {device['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, launch overhead "
                  f"{device['launch_overhead_ns'] / 1000:g} µs", highlight=False)
    for note in a["notes"]:
        console.print(f"  [dim]• {note}[/]", highlight=False)
    floor = doc["weight_floor"]
    console.print(f"\n[bold]weight floor[/]: {floor['weight_bytes'] / GIB:.2f} GiB of weights per "
                  f"decode step → {_ms(floor['ns'])} ms ({_rate(floor['tokens_per_s'])} tokens/s "
                  "at C=1)", highlight=False)
    console.print(_cases(doc))
    console.print(_memory(doc["memory_fit"]))
    console.print(_plans(doc["plans"]))
    console.print(_gaps(doc["gaps"]))
    console.print(_coverage(doc["coverage"]))
    if "parallel" in doc:
        from fuel.report.parallel_render import render_parallel_text

        console.print(render_parallel_text(doc["parallel"]))
    for mode, missing in doc["serve"].items():
        verdict = "[green]servable at every tier[/]" if not missing else \
            f"[bold red]no plan at {', '.join(missing)}[/]"
        console.print(f"serve {mode}: {verdict}", highlight=False)


def _cases(doc: Mapping[str, Any]) -> Table:
    t = Table(title="roofline per case (ceiling = no launch overhead)", title_justify="left")
    for col in ("case", "rows", "ceiling ms", "+launch ms", "launches", "tok/s ceiling",
                "tok/s +launch", "weights GiB", "KV GiB", "planned"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for c in doc["roofline"]:
        t.add_row(c["name"], str(c["rows"]), _ms(c["ceiling_ns"]), _ms(c["with_launch_ns"]),
                  str(c["launches"]), _rate(c["tokens_per_s_ceiling"]),
                  _rate(c["tokens_per_s_with_launch"]), f"{c['weight_bytes'] / GIB:.2f}",
                  f"{c['kv_bytes'] / GIB:.2f}", "yes" if c["planned"] else "[yellow]gaps[/]")
    return t


def _memory(fit: Mapping[str, Any]) -> Group:
    concurrencies = sorted({c["concurrency"] for c in fit["cells"]})
    contexts = sorted({c["context"] for c in fit["cells"]})
    by = {(c["context"], c["concurrency"]): c for c in fit["cells"]}
    t = Table(title="memory fit (usable = 90% of device memory)", title_justify="left")
    t.add_column("context")
    for c in concurrencies:
        t.add_column(f"C={c}", justify="right")
    for ctx in contexts:
        row = []
        for c in concurrencies:
            cell = by[(ctx, c)]
            row.append("[green]fits[/]" if cell["fits"] else
                       f"[red]-{cell['shortfall_bytes'] / GIB:.1f}G[/]")
        t.add_row(str(ctx), *row)
    head = Text(f"weights {fit['weight_bytes'] / GIB:.2f} GiB, KV {fit['kv_bytes_per_token']:,} "
                f"B/token ({fit['kv_format']}), usable {fit['usable_bytes'] / GIB:.2f} of "
                f"{fit['device_bytes'] / GIB:.2f} GiB")
    return Group(Text(""), head, t)


def _plans(plans: list[Mapping[str, Any]]) -> Group:
    t = Table(title="fused plans", title_justify="left")
    for col in ("mode", "rows", "table", "digest", "groups", "launches", "copies", "fused",
                "materialized", "novel"):
        t.add_column(col, justify="left" if col in ("mode", "table", "digest") else "right")
    for p in plans:
        t.add_row(p["mode"], str(p["rows"]), p["table"] or "", p["digest"][:16], str(p["groups"]),
                  str(p["launches"]), str(p["copies"]), str(p["fused_edges"]),
                  str(p["materialized_edges"]), str(p["novel_groups"]))
    # The first plan's sites in full, then only the sites where another mode differs from it
    # (the JSON and the HTML page hold every mode's full table).
    sites = Table(title="by site (first mode in full; other modes: only sites that differ)",
                  title_justify="left")
    for col in ("mode", "block", "locals", "kernels", "rule", "count"):
        sites.add_column(col, justify="right" if col == "count" else "left")
    base: set[tuple] = set()
    for i, p in enumerate(plans):
        for s in p["sites"]:
            key = (s["block"], tuple(s["locals"]), s["rule"], s["count"])
            if i == 0:
                base.add(key)
            elif key in base:
                continue
            sites.add_row(p["mode"], s["block"], " + ".join(s["locals"]),
                          ", ".join(s["kernels"]) or "(host)", s["rule"], str(s["count"]))
    return Group(t, sites)


def _gaps(gaps: list[Mapping[str, Any]]) -> Table | Text:
    if not gaps:
        return Text("gaps: none — every op has a rule on this device", style="green")
    t = Table(title="gaps: ops no rule covers, and the JIT request each would make",
              title_justify="left")
    for col in ("op", "site", "modes", "count", "share", "JIT request"):
        t.add_column(col, justify="right" if col in ("count", "share") else "left")
    for g in gaps:
        req = g["request"]
        what = (f"{req['fused_op']} on {req['backend']} ({len(req['operands'])} operands)"
                if req["status"] == "request" else f"declined: {req['reason']}")
        t.add_row(g["op"], f"{g['block']}.{g['local']}", ", ".join(g["modes"]), str(g["count"]),
                  f"{100 * g['share_of_step']:.1f}%", what)
    return t


def _coverage(cells: list[Mapping[str, Any]]) -> Group:
    t = Table(title="coverage matrix (launches, or ✗ with the reason below)", title_justify="left")
    t.add_column("mode")
    t.add_column("tiers")
    modes: dict[str, list[str]] = {}
    reasons: dict[str, list[str]] = {}
    for c in cells:
        mark = f"[green]{c['tier']}:{c['launches']}[/]" if c["planned"] else \
            f"[red]{c['tier']}:✗[/]"
        modes.setdefault(c["mode"], []).append(mark)
        if not c["planned"]:
            reasons.setdefault(c["reason"] or "not planned", []).append(f"{c['mode']} {c['tier']}")
    for mode, marks in modes.items():
        t.add_row(mode, "  ".join(marks))
    lines = [Text.from_markup(f"  [red]✗[/] {', '.join(where)}: ") + Text(reason)
             for reason, where in reasons.items()]
    return Group(t, *lines)
