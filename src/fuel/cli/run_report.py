"""The run report ``fuel run`` and ``fuel demo`` print after the answer.

Decides what a person reads once the text is generated. By default (``--report short``) a
summary of a few lines: tokens, decode and prefill tokens/s, time to first token, the weights'
formats and bytes read per token, the bandwidth floor and the measured/floor ratio, threads,
program builds, then one line per kind of decision the optimizer made, aggregated over every
step program of the run (``paged_attn: JIT kernel adopted at 60 sites in 2 programs, 3.7x to
562x faster than the recipe``). ``--report full`` (``-v``) adds the tables: steps by mode, plans,
bake decisions, routes, expert load, JIT adoptions and the baked branches, each deduplicated —
one row per distinct decision, the step programs it applies to listed in a column.

Invariants: every number comes from the run's report dict
(:func:`fuel.runtime.model.report`, exactly what ``--json`` prints; nothing is estimated here:
ratios are quotients of recorded numbers). Every line fits the console's width: text wraps at
spaces, table columns are chosen so their longest word fits 80 columns, so no name is cut or
ellipsized. A step program is named ``MODE ROWS/wWIDTH`` (rows per step, or the verify row
table, and the block-table width).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

REPORTS = ("short", "full")

JIT_LABEL = "fused:runtime#"
"""How an adopted (runtime fused) kernel's arm is labelled in the bake's records."""

ADOPTED = ("adopted", "already adopted")
_OUTCOMES = {"adopted": "adopted", "already adopted": "reused",
             "rejected: slower than the decomposed region": "slower"}
"""Adoption outcomes whose numbers say the rest (the others print their reason)."""


# -- small formats ----------------------------------------------------------------------------

def step_name(row: dict[str, Any]) -> str:
    """``decode 1/w4``: mode, rows per step (or the verify row table), block-table width."""
    return f"{row['mode']} {row['table'] or row['rows']}/w{row['block_table_width']}"


def steps_text(rows: Iterable[dict[str, Any]]) -> str:
    """Step programs grouped by mode: ``decode 1/w4, 1/w8; prefill 47/w4``."""
    by_mode: dict[str, list[str]] = {}
    for row in rows:
        shape = f"{row['table'] or row['rows']}/w{row['block_table_width']}"
        shapes = by_mode.setdefault(row["mode"], [])
        if shape not in shapes:
            shapes.append(shape)
    return "; ".join(f"{mode} {', '.join(shapes)}" for mode, shapes in by_mode.items())


def _time(ns: float | None) -> str:
    """A kernel time in a table cell: one word (``6.30ms``), so it never wraps."""
    if ns is None:
        return "-"
    if ns >= 1e9:
        return f"{ns / 1e9:.2f}s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f}ms"
    return f"{ns / 1e3:.1f}us"


def _times(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def _span(ratios: list[float]) -> str:
    low, high = min(ratios), max(ratios)
    return _times(low) if _times(low) == _times(high) else f"{_times(low)} to {_times(high)}"


def _count(n: int, what: str, plural: str | None = None) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {plural or what + 's'}"


def _num(value: float) -> str:
    """Three significant digits, never in exponent form (18.9, 0.00211, 124, 47231)."""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if value >= 1e-4 else f"{value:.2g}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# -- one line per kind of decision -------------------------------------------------------------

_LOWERED = re.compile(r"lowered to recipe: (?P<ops>.*?); arms offered")


def lowered_ops(decisions: str) -> dict[str, int]:
    """``{op: count}`` of the fused ops a program lowered to their recipe (from its
    optimize_graph summary, ``lowered to recipe: paged_attn x30, ...``)."""
    match = _LOWERED.search(decisions)
    if match is None or match["ops"] == "none":
        return {}
    out: dict[str, int] = {}
    for part in match["ops"].split(", "):
        name, _, count = part.rpartition(" x")
        if name and count.isdigit():
            out[name] = int(count)
    return out


@dataclass
class _Kind:
    """What the run's programs decided for one region (fused op)."""

    won: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    """Winning arm's name -> the branch groups it won."""
    kept: list[dict[str, Any]] = field(default_factory=list)
    plain: list[tuple[dict[str, Any], int]] = field(default_factory=list)
    """(program, sites) lowered to the recipe with no branch offered."""
    refused: Counter = field(default_factory=Counter)
    """Adoption outcome -> shapes refused (verification, cost gate, synthesizer)."""
    sources: set[str] = field(default_factory=set)


def _arm_name(label: str) -> str:
    """How a winning arm is named: an adopted JIT kernel, or a variant kernel the bake chose."""
    return "JIT kernel adopted" if label.startswith(JIT_LABEL) else f"variant {label} baked"


def _programs(groups: Iterable[tuple[dict[str, Any], int]]) -> str:
    """``at 60 sites in 2 programs`` (the programs named when there are few)."""
    sites: Counter = Counter()
    programs: dict[str, dict[str, Any]] = {}
    for program, count in groups:
        programs.setdefault(step_name(program), program)
        sites[step_name(program)] += count
    text = f"at {_count(sum(sites.values()), 'site')} in {_count(len(programs), 'program')}"
    if len(programs) <= 2:
        text += f" ({steps_text(programs.values())})"
    return text


def decision_kinds(result: dict[str, Any]) -> list[tuple[str, str]]:
    """``(region, line)`` per kind of decision, aggregated over the run's step programs: which
    arm won where and by how much (recipe cost / winner cost, Judge-measured per site), where
    the recipe was kept and why, and where it ran with no kernel offered (adoption refused,
    JIT off)."""
    kinds: dict[str, _Kind] = defaultdict(_Kind)
    for program in result.get("bake_decisions", []):
        branched: Counter = Counter()
        for group in program.get("branches", []):
            region, arms = group["region"], group["arms"]
            kind = kinds[region]
            branched[region] += group["count"]
            kind.sources.update(a["source"] for a in arms if a["source"])
            entry = {**group, "program": program}
            if group["winner"]:
                kind.won[_arm_name(arms[group["winner"]]["label"])].append(entry)
            else:
                kind.kept.append(entry)
        for region, count in lowered_ops(program.get("decisions", "")).items():
            if count > branched[region]:
                kinds[region].plain.append((program, count - branched[region]))
    jit = result.get("jit") or {}
    for row in jit.get("adoptions", []):
        if row["outcome"] not in ADOPTED:
            kinds[row["region"]].refused[row["outcome"]] += 1
    lines = []
    for region in sorted(kinds):
        kind, parts = kinds[region], []
        for name, groups in kind.won.items():
            costs = [(g["arms"][0]["cost_ns"], g["arms"][g["winner"]]["cost_ns"]) for g in groups]
            ratios = [recipe / winner for recipe, winner in costs if recipe and winner]
            text = f"{name} {_programs((g['program'], g['count']) for g in groups)}"
            if ratios:
                text += f", {_span(ratios)} faster than the recipe"
            parts.append(text)
        if kind.kept:
            reasons = Counter()
            slower = []
            for group in kind.kept:
                reasons[group["reason"]] += group["count"]
                recipe = group["arms"][0]["cost_ns"]
                others = [a["cost_ns"] for a in group["arms"][1:] if a["cost_ns"]]
                if recipe and others:
                    slower.append(min(others) / recipe)
            text = (f"recipe kept {_programs((g['program'], g['count']) for g in kind.kept)}: "
                    f"{', '.join(reasons)}")
            if slower and all(r >= 1 for r in slower):
                text += f" (the kernel {_span(slower)} slower)"
            parts.append(text)
        if kind.plain:
            text = f"recipe runs {_programs(kind.plain)}, no kernel offered"
            if kind.refused:
                text += " (" + "; ".join(f"{outcome} at {_count(n, 'shape')}"
                                         for outcome, n in kind.refused.items()) + ")"
            elif not jit.get("enabled"):
                text += " (no CPU kernel; JIT off)"
            parts.append(text)
        elif kind.refused:
            parts.append("; ".join(f"{outcome} at {_count(n, 'shape')}"
                                   for outcome, n in kind.refused.items()))
        estimated = kind.sources - {"judge"}
        if estimated:
            parts.append(f"some costs priced by {', '.join(sorted(estimated))}")
        lines.append((region, "; ".join(parts)))
    return lines


# -- the summary -------------------------------------------------------------------------------

def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """``(label, text)`` lines of the short report (see the module docs)."""
    rows: list[tuple[str, str]] = []
    rate, steady = result["decode_tokens_per_s"], result["decode_tokens_per_s_steady"]
    decode = f"{_rate(steady)} tokens/s"
    if rate is not None and steady is not None and _rate(rate) != _rate(steady):
        decode += f" ({_rate(rate)} counting the programs built while decoding)"
    rows.append(("decode", decode))
    prompt = sum(result.get("prompt_tokens", []))
    prefill_s = result["prefill_s"]
    if prefill_s > 0:
        text = f"{prompt / prefill_s:.1f} tokens/s ({prompt} prompt tokens in {prefill_s:.2f} s"
        built = (result["program_builds"].get("prefill") or {}).get("seconds", 0.0)
        if built and prefill_s > built:
            text += (f"; {prompt / (prefill_s - built):.1f} tokens/s without its "
                     f"{built:.2f} s of program builds")
        rows.append(("prefill", text + ")"))
    rows.append(("first token", f"after {result['time_to_first_token_s']:.2f} s"))
    weights = result.get("weights")
    if weights:
        formats = sorted(weights["formats"].items(), key=lambda item: -item[1])
        rows.append(("weights", ", ".join(f"{fmt} {size / 1e6:.1f} MB" for fmt, size in formats)
                     + f"; {weights['bytes_per_token'] / 1e6:.1f} MB read per token"))
        floor = weights["floor_ms_per_token"]
        if floor is not None:
            source = weights["bandwidth_source"].split(" (")[0].split(":")[0]
            text = (f"{_num(floor)} ms/token ({_num(weights['floor_tokens_per_s'])} tokens/s "
                    f"at {weights['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, {source})")
            if steady and floor > 0:
                measured = 1e3 / steady
                text += (f"; measured {_num(measured)} ms/token, {_num(measured / floor)}x the "
                         "floor")
                if result["sequences"] > 1:
                    text += f" (a step decodes {result['sequences']} sequences)"
            rows.append(("floor", text))
    builds = result["program_builds"]
    if builds:
        restored = sum(row.get("restored_from_disk", 0) for row in builds.values())
        count = sum(row["count"] for row in builds.values())
        seconds = sum(row["seconds"] for row in builds.values())
        text = ", ".join(f"{mode} {row['count']}" for mode, row in builds.items())
        if restored == count:
            text += f" restored from disk in {seconds:.2f} s"
        elif not restored:
            text += (f" built in {seconds:.2f} s (lowering, JIT adoption, Judge measurement, "
                     "bake; stored for later runs)")
        else:
            text += (f" in {seconds:.2f} s: {count - restored} built (stored for later runs), "
                     f"{restored} restored from disk")
        rows.append(("programs", text))
    for note in (result.get("program_cache") or {}).get("notes", []):
        rows.append(("program cache", note))
    if "speculation" in result:
        spec = result["speculation"]
        share = f"{spec['acceptance_rate']:.1%}" if spec["acceptance_rate"] is not None else "-"
        rows.append(("speculation", f"k={spec['k']}, {spec['drafter']} drafter: accepted "
                                    f"{spec['accepted']} of {spec['proposed']} ({share})"))
    for mode, row in (result.get("experts") or {}).items():
        rows.append((f"experts {mode}", f"{row['distinct_experts_per_layer']} of "
                                        f"{row['experts']} (k={row['top_k']}) per MoE layer and "
                                        f"step; uniform routing would read "
                                        f"{row['uniform_routing_per_layer']}"))
    if result.get("routes"):
        branches = {(r["mode"], r["branch"]) for r in result["routes"]}
        devices = sorted({r["device"] for r in result["routes"]})
        live = _count(len(branches), "live branch", "live branches")
        rows.append(("routes", f"{live} routed per step by the route picker, on "
                               f"{', '.join(devices)}"))
    native = result.get("native_kernels") or {}
    if native.get("available") is False:
        rows.append(("native", f"kernels unavailable ({native['reason']}): every step runs "
                               "torch's kernels node by node, several times slower"))
    jit = result.get("jit") or {}
    if not jit.get("enabled"):
        rows.append(("jit", jit.get("note", "off")))
    else:
        outcomes = Counter(row["outcome"] for row in jit.get("adoptions", []))
        cells = jit.get("judge_rows_measured", 0)
        if outcomes or cells:
            adopted, reused = outcomes.pop("adopted", 0), outcomes.pop("already adopted", 0)
            text = (f"{_count(adopted + reused + sum(outcomes.values()), 'region shape')} tried "
                    f"this run: {adopted} adopted (synthesized and verified), {reused} reused an "
                    f"adopted kernel, {sum(outcomes.values())} refused; "
                    f"{_count(cells, 'Judge cell')} measured")
        else:
            text = "every program restored: nothing compiled or measured this run"
        rows.append(("jit", text))
        rows.extend(("jit", note) for note in jit.get("notes", []))
    return rows


def _grid(rows: list[tuple[str, str]], indent: int = 0) -> Table:
    """Label/text lines: labels never wrap, the text wraps at spaces under itself."""
    grid = Table.grid(padding=(0, 2, 0, 0), pad_edge=False)
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    for label, text in rows:
        grid.add_row(" " * indent + label, text)
    return grid


def print_summary(console: Console, result: dict[str, Any], *, full: bool = False) -> None:
    console.print(f"[bold]{escape(result['model'])}[/], {result['dtype']} weights, "
                  f"{result['threads']} threads: {_count(result['generated_tokens'], 'token')} for "
                  f"{_count(result['sequences'], 'sequence')}", markup=True)
    console.print(_grid(summary_rows(result)))
    kinds = decision_kinds(result)
    if kinds:
        hint = "" if full else " (-v: the tables)"
        console.print(f"[bold]decisions[/] by kind over all step programs{hint}:", markup=True)
        console.print(_grid(kinds, indent=2))


# -- the full report: today's tables, deduplicated ---------------------------------------------

def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0), title_justify="left", title_style="bold")
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _print(console: Console, table: Table) -> None:
    """Print ``table`` with no word cut: when its cells do not fit the console on one line each,
    every column gets its longest word, then the room left goes to the columns that lack the
    least first (short columns stay on one line, long text wraps). Rich's own collapse would
    shrink the widest column below its longest word and cut it. The column sets are chosen so
    their longest words fit 80 columns."""
    columns = table.columns
    texts = [[str(column.header), *(str(cell) for cell in column.cells)] for column in columns]
    words = [max((len(w) for text in cells for w in text.split()), default=1) for cells in texts]
    lines = [max((len(line) for text in cells for line in text.splitlines()), default=1)
             for cells in texts]
    room = console.width - table._extra_width - sum(
        table._get_padding_width(index) for index in range(len(columns)))
    if sum(lines) > room >= sum(words):
        widths, spare = list(words), room - sum(words)
        for index in sorted(range(len(columns)), key=lambda i: lines[i] - words[i]):
            give = min(lines[index] - words[index], spare)
            widths[index] += give
            spare -= give
        for column, width in zip(columns, widths):
            column.width = width
    elif room < sum(words):
        # Too narrow for the columns' longest words: one block of "header: value" lines per
        # row instead, each wrapped at spaces.
        console.print(table.title, style="bold", markup=False)
        for row in range(table.row_count):
            if row:
                console.print()
            console.print(_grid([(str(column.header), texts[index][row + 1])
                                 for index, column in enumerate(columns)], indent=1))
        return
    console.print(table)


def print_tables(console: Console, result: dict[str, Any]) -> None:
    steps = _table("steps by mode", "mode", "steps", "rows/step", "launches/step",
                   "kernel calls/step", "host calls/step", "threads (steps)")
    for mode, row in result["steps"].items():
        threads = row.get("threads") or {}
        steps.add_row(mode, str(row["steps"]), str(row["rows_per_step"]),
                      str(row["launches_per_step"]), str(row["kernel_calls_per_step"]),
                      str(row.get("host_calls_per_step", "-")),
                      ", ".join(f"{n} ({count})" for n, count in threads.items()) or "-")
    _print(console, steps)
    digests = _table("plans used", "plan digest", "mode")
    for digest, what in result["plan_digests"].items():
        digests.add_row(digest[:16], what)
    _print(console, digests)
    grouped: dict[tuple, list[dict[str, Any]]] = {}
    for row in result["bake_decisions"]:
        grouped.setdefault((row["decisions"], row["adopted_kernel_calls_per_step"]), []).append(row)
    bakes = _table("bake decisions (one row per distinct decision)", "steps",
                   "optimize_graph decisions", "adopted calls/step")
    for (decisions, adopted), rows in grouped.items():
        bakes.add_row(steps_text(rows), decisions, str(adopted))
    _print(console, bakes)
    if result.get("routes"):
        routes = _table("routes taken at live branches (route picker, live signals)",
                        "mode", "branches", "arm", "device", "steps", "why")
        merged: dict[tuple, list[str]] = {}
        for row in result["routes"]:
            key = (row["mode"], row["arm"], row["device"], row["steps"], row["reason"])
            merged.setdefault(key, []).append(f"%{row['branch']}")
        for (mode, arm, device, count, why), branches in merged.items():
            routes.add_row(mode, ", ".join(branches), str(arm), device, str(count), why)
        _print(console, routes)
    print_experts(console, result)
    print_jit(console, result)


def print_experts(console: Console, result: dict[str, Any]) -> None:
    """MoE expert load per step (measured from the routing each step took)."""
    load = result.get("experts")
    if not load:
        return
    table = _table("expert load (measured routing; uniform = E*(1-(1-k/E)^T))", "mode",
                   "rows/step", "MoE layers", "distinct experts/layer",
                   "uniform routing per layer", "distinct experts per step",
                   "expert bytes per step")
    for mode, row in load.items():
        table.add_row(mode, str(row["rows_per_step"]), str(row["moe_layers"]),
                      f"{row['distinct_experts_per_layer']} of {row['experts']} (k={row['top_k']})",
                      str(row["uniform_routing_per_layer"]), str(row["distinct_experts_per_step"]),
                      f"{row['expert_bytes_per_step']:,}")
    _print(console, table)


def print_jit(console: Console, result: dict[str, Any]) -> None:
    """Adoptions (one row per region and shape), then the baked branches deduplicated."""
    jit = result.get("jit") or {}
    if not jit.get("enabled"):
        console.print(f"jit: {jit.get('note', 'off')}")
        return
    if jit["adoptions"]:
        adoptions = _table("jit adoptions, one row per region and shape (numba or native C, verified "
                           "against the recipe; reused: the kernel adopted at another shape; "
                           "slower: refused, the recipe runs)", "region", "output", "outcome",
                           "max error", "kernel", "recipe")
        for row in jit["adoptions"]:
            error = "-" if row["max_abs_error"] is None else f"{row['max_abs_error']:.1e}"
            outcome = _OUTCOMES.get(row["outcome"], f"{row['outcome']}: {row['reason']}")
            adoptions.add_row(row["region"], row["output"].replace(", ", ","), outcome, error,
                              _time(row["kernel_ns"]), _time(row["decomposed_ns"]))
        _print(console, adoptions)
    grouped: dict[tuple, dict[str, Any]] = {}
    for program in result["bake_decisions"]:
        for branch in program.get("branches", []):
            arms = tuple((a["cost_ns"], a["source"], a["declined"]) for a in branch["arms"])
            key = (branch["region"], branch["winner"], branch["reason"], branch["count"], arms)
            grouped.setdefault(key, {"branch": branch, "programs": []})["programs"].append(program)
    if not grouped:
        return
    branches = _table(f"branches as baked, one row per distinct decision (costs per site: "
                      f"Judge-measured unless marked; {jit['judge_rows_measured']} cells measured "
                      "this run)", "region", "steps", "sites", "recipe", "kernel", "winner")
    for entry in sorted(grouped.values(), key=lambda e: e["branch"]["region"]):
        branch = entry["branch"]
        cost = [_time(a["cost_ns"]) + ("" if a["source"] == "judge" else
                                       f" ({a['source'] or a['declined']})")
                for a in branch["arms"]]
        winner = "recipe" if branch["winner"] == 0 else (
            "kernel" if len(cost) == 2 else f"arm {branch['winner']}")
        if not (branch["winner"] and branch["reason"] == "cheaper"):
            winner += f": {branch['reason']}"
        branches.add_row(branch["region"], steps_text(entry["programs"]), str(branch["count"]),
                         cost[0], ", ".join(cost[1:]) or "-", winner)
    _print(console, branches)


def print_report(console: Console, result: dict[str, Any], *, full: bool = False) -> None:
    """The run report: the summary, and with ``full`` the tables."""
    console.print()
    print_summary(console, result, full=full)
    if full:
        console.print()
        print_tables(console, result)


__all__ = ["REPORTS", "decision_kinds", "lowered_ops", "print_report", "print_tables",
           "step_name", "steps_text", "summary_rows"]
