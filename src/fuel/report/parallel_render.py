"""How the report's ``parallel`` object is shown: rich text for the terminal, a section of the
HTML page. Decides layout only; every number comes from :mod:`fuel.report.parallel`."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

GIB = 2**30


def _ms(ns: float | None) -> str:
    return "–" if ns is None else f"{ns / 1e6:.3f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _link(doc: Mapping[str, Any]) -> str:
    intra, inter = doc["interconnect"]["intra_node"], doc["interconnect"]["inter_node"]
    text = intra["title"] if intra and intra.get("name") else f"no link ({intra['reason']})"
    if inter:
        text += f"; between servers {inter['title']}"
    return text


def parallel_rows(doc: Mapping[str, Any]) -> dict[str, list[list[str]]]:
    """The tables as rows of strings (shared by text and HTML)."""
    steps = [[s["name"], _ms(s["ns"]), _ms(s["collective_ns"]), _pct(s["collective_share"]),
              "–" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"]
             for s in doc["steps"]]
    stages = [[str(s["stage"]), f"{s['layers'][0]}..{s['layers'][1] - 1}",
               f"{s['weight_bytes'] / GIB:.2f}", f"{s['kv_bytes_per_token']:,}",
               f"{s['activation_bytes'] / GIB:.2f}", f"{s['workspace_bytes'] / GIB:.2f}"]
              for s in doc["stages"]]
    fit = doc["fit"]
    reverse = ([[f"C={r['concurrency']}", f"{r['max_context']:,} tokens"] for r in fit["max_context"]]
               + [[f"context {r['context']:,}", f"C={r['max_concurrency']}"]
                  for r in fit["max_concurrency"]])
    ranks = [[str(r["rank"]), str(r["stage"]), str(r["tp_rank"]),
              (r["decode_digest"] or "no plan")[:16]] for r in doc["ranks"]]
    return {"steps": steps, "stages": stages, "reverse": reverse, "ranks": ranks}


def _suggestion(doc: Mapping[str, Any]) -> str:
    s = doc["suggestion"]
    if s["tp"] is None:
        return "no layout up to tp=8 x pp=8 fits the stated context"
    return (f"smallest layout that fits the stated context at C=1: tp={s['tp']} pp={s['pp']} "
            f"({s['world']} GPUs, {s['need_bytes'] / GIB:.1f} GiB per rank)")


def render_parallel_text(doc: Mapping[str, Any]) -> Group:
    lay, rows = doc["layout"], parallel_rows(doc)
    head = Text(f"\nparallel: tp={lay['tp']} pp={lay['pp']} ep={lay['ep']} ({lay['world']} ranks on "
                f"{lay['nodes']} server(s)); {_link(doc)}; usable per rank "
                f"{doc['usable_bytes_per_rank'] / GIB:.1f} GiB "
                f"(utilization {doc['utilization']:g})")
    tables = []
    for title, cols, key in (
            ("per-rank step (roofline + collectives)", ("case", "step ms", "collective ms", "share",
                                                          "tok/s"), "steps"),
            ("per stage (GiB; KV B/token)", ("stage", "layers", "weights", "KV/token",
                                             "activations", "workspace"), "stages"),
            ("fit solved in reverse", ("given", "largest"), "reverse"),
            ("ranks and their decode plan digests", ("rank", "stage", "tp rank", "digest"), "ranks")):
        t = Table(title=title, title_justify="left")
        for c in cols:
            t.add_column(c, justify="left" if c in ("case", "given") else "right")
        for r in rows[key]:
            t.add_row(*r)
        tables.append(t)
    fit = doc["fit"]
    verdict = Text(("fits" if fit["fits"] else "does NOT fit") + f" at the stated context, C=1 "
                   f"(need {fit['need_bytes'] / GIB:.1f} GiB per rank); KV cache "
                   f"{fit['kv_cache_tokens']:,} tokens per rank")
    return Group(head, *tables, verdict, Text(_suggestion(doc)), Text(doc["vllm_command"]),
                 *(Text(f"  • {n}", style="dim") for n in doc["notes"]))


def render_parallel_html(doc: Mapping[str, Any], table: Any) -> str:
    """The HTML section; ``table(head, rows)`` is the page's table helper."""
    lay, rows = doc["layout"], parallel_rows(doc)
    esc = [[escape(c) for c in r] for r in rows["steps"]]
    parts = [
        "<h2>Parallel layout</h2>",
        f"<p>tp={lay['tp']} pp={lay['pp']} ep={lay['ep']}: {lay['world']} ranks on {lay['nodes']} "
        f"server(s); {escape(_link(doc))}; usable per rank "
        f"{doc['usable_bytes_per_rank'] / GIB:.1f} GiB.</p>",
        table(("case", "step ms", "collective ms", "share", "tok/s"), esc),
        table(("stage", "layers", "weights GiB", "KV B/token", "activations GiB", "workspace GiB"),
              [[escape(c) for c in r] for r in rows["stages"]]),
        table(("given", "largest"), [[escape(c) for c in r] for r in rows["reverse"]]),
        table(("rank", "stage", "tp rank", "decode digest"),
              [[escape(c) for c in r] for r in rows["ranks"]]),
        f"<p>{escape(_suggestion(doc))}</p><pre>{escape(doc['vllm_command'])}</pre>",
        "<ul>" + "".join(f"<li>{escape(n)}</li>" for n in doc["notes"]) + "</ul>",
    ]
    return "\n".join(parts)
