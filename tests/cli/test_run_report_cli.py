"""The run report of ``fuel run`` / ``fuel demo``: a short summary by default (no table, one line
per kind of decision), ``--report full`` / ``-v`` with the tables deduplicated, every line
within 80 columns with no name cut, and progress drawn only on a terminal's stderr.

The rendering tests read a recorded run (``data/run_result.json``: ``fuel demo -n 8 --json`` on
SmolLM2 with JIT, programs built) so they are fast and exact; the ``slow`` tests run the real
CLI the way ``test_run_cli.py`` does.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

from fuel.cli import main
from fuel.cli.run_report import decision_kinds, lowered_ops, print_report

RECORDED = Path(__file__).parent / "data" / "run_result.json"
TABLE_RULES = ("─", "━", "┃", "│", "┏", "└")
REGIONS = ("paged_attn", "quant_linear", "residual_add_rms_norm")


def recorded() -> dict:
    return json.loads(RECORDED.read_text())


def render(result: dict, *, full: bool = False, width: int = 80) -> str:
    out = io.StringIO()
    print_report(Console(file=out, width=width, highlight=False, force_terminal=False), result,
                 full=full)
    return out.getvalue()


def with_a_wider_decode_table(result: dict) -> dict:
    """The recorded run plus a decode program at block-table width 8 that decided exactly what
    the width-4 one did (a longer run builds one per width)."""
    result = copy.deepcopy(result)
    decode = next(row for row in result["bake_decisions"] if row["mode"] == "decode")
    wider = copy.deepcopy(decode)
    wider["block_table_width"] = 8
    result["bake_decisions"].append(wider)
    return result


def flat(text: str) -> str:
    """The text with its wrapping undone (lines wrap at spaces)."""
    return " ".join(text.split())


def assert_fits_80_columns(text: str) -> None:
    for line in text.splitlines():
        assert len(line) <= 80, line
    assert "…" not in text and "..." not in text


# -- the default: a summary ---------------------------------------------------------------------

def test_default_report_is_a_few_summary_lines_and_no_table():
    text = render(recorded())
    assert not any(rule in text for rule in TABLE_RULES)
    assert len(text.splitlines()) <= 40
    labels = [line.split()[0] for line in text.splitlines() if line and not line[0].isspace()]
    for label in ("decode", "prefill", "first", "weights", "floor", "programs", "jit",
                  "decisions"):
        assert label in labels, label
    assert "2 threads" in text and "8 tokens" in text
    assert "tokens/s" in text and "MB read per token" in flat(text)
    # measured / floor: 1000 / 10.07 tokens/s = 99.3 ms per token over an 18.9 ms floor
    assert "measured 99.3 ms/token, 5.26x the floor" in flat(text)


def test_default_report_has_one_line_per_kind_of_decision():
    text = render(recorded())
    starts = [line.split()[0] for line in text.splitlines() if line.startswith("  ")
              and line.split()[0] in REGIONS]
    assert sorted(starts) == sorted(REGIONS)
    kinds = dict(decision_kinds(recorded()))
    # paged_attn: the kernel won in both programs, 3.7x (prefill) to 562x (decode) per site
    assert kinds["paged_attn"] == ("JIT kernel adopted at 60 sites in 2 programs (prefill "
                                   "47/w4; decode 1/w4), 3.7x to 562x faster than the recipe")
    assert "recipe kept at 59 sites in 1 program (prefill 47/w4): arm 0 cheapest" in \
        kinds["residual_add_rms_norm"]
    # the two prefill shapes adoption refused (slower) run the recipe, unbranched
    assert ("recipe runs at 31 sites in 1 program (prefill 47/w4), no kernel offered "
            "(rejected: slower than the decomposed region at 2 shapes)") in kinds["quant_linear"]


def test_decision_kinds_aggregate_over_programs_not_per_program():
    kinds = dict(decision_kinds(with_a_wider_decode_table(recorded())))
    assert kinds["paged_attn"].startswith("JIT kernel adopted at 90 sites in 3 programs,")


def test_without_jit_each_lowered_op_is_one_line_saying_the_recipe_runs():
    result = recorded()
    result["jit"] = {"enabled": False, "note": "off (--no-jit)"}
    for row in result["bake_decisions"]:
        row["branches"] = []
    kinds = dict(decision_kinds(result))
    assert kinds["paged_attn"] == ("recipe runs at 60 sites in 2 programs (prefill 47/w4; "
                                   "decode 1/w4), no kernel offered (no CPU kernel; JIT off)")


def test_lowered_ops_reads_the_bake_summary():
    assert lowered_ops("lowered to recipe: paged_attn x30, quant_linear x211; arms offered: 3") \
        == {"paged_attn": 30, "quant_linear": 211}
    assert lowered_ops("lowered to recipe: none; arms offered: 0") == {}


# -- --report full: the tables, deduplicated ------------------------------------------------------

def test_full_report_shows_each_distinct_decision_once_with_its_steps():
    text = render(with_a_wider_decode_table(recorded()), full=True)
    for title in ("steps by mode", "plans used", "bake decisions", "jit adoptions",
                  "branches as baked"):
        assert title in text, title
    # the width-4 and width-8 decode programs decided the same: one row names both
    assert text.count("decode 1/w4, 1/w8") >= 2  # bake decisions and each shared branch row
    bake = text.split("bake decisions")[1].split("jit adoptions")[0]
    assert flat(bake).count("arms offered: 300") == 1
    branches = text.split("branches as baked")[1]
    rows = [line for line in branches.splitlines() if line.strip().startswith(REGIONS)]
    assert len(rows) == len({line for line in rows})
    assert len(rows) == 12  # 12 distinct decisions; 19 branch groups over the 3 programs


@pytest.mark.parametrize("full", [False, True], ids=["short", "full"])
@pytest.mark.parametrize("width", [80, 100])
def test_no_line_is_wider_than_the_console_and_no_name_is_cut(full, width):
    text = render(with_a_wider_decode_table(recorded()), full=full, width=width)
    for line in text.splitlines():
        assert len(line) <= width, line
    assert "…" not in text
    words = set(re.findall(r"[a-z_]+", text))
    for region in REGIONS:
        assert region in words
    assert not words & {"quant_li", "paged_at", "residual_"}


def test_a_console_too_narrow_for_a_table_gets_its_rows_as_labelled_lines():
    text = render(recorded(), full=True, width=50)
    for line in text.splitlines():
        assert len(line) <= 50, line
    assert "residual_add_rms_norm" in text and "…" not in text


def test_streamed_answer_wraps_at_spaces_within_the_width():
    from fuel.cli.run import StreamWrap

    wrap = StreamWrap(20)
    pieces = ["An", " inference", " engine", " uses", " machine", " learning", "\n\n", "Next"]
    text = "".join(wrap(piece) for piece in pieces)
    assert text == "An inference engine \nuses machine \nlearning\n\nNext"
    assert wrap.column == 4
    assert all(len(line) <= 20 for line in text.splitlines())


# -- the real CLI ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_outputs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """(stdout, stderr) of a default run and a --report full run, at COLUMNS=80, off a
    terminal (as CI and pipes see it)."""
    cache = os.environ.get("FUEL_CACHE_DIR") or str(tmp_path_factory.mktemp("fuel-cache"))
    outputs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FUEL_CACHE_DIR", cache)
        patch.setenv("COLUMNS", "80")
        # The default run's answer is long enough to wrap at 80 columns.
        for name, extra in (("short", ["-n", "16"]), ("full", ["-n", "4", "--report", "full"]),
                            ("verbose", ["-n", "4", "-v"])):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = main(["run", "-p", "Name a planet.", "--threads", "2", *extra])
            assert status == 0, err.getvalue()
            outputs[name] = (out.getvalue(), err.getvalue())
    return outputs


@pytest.mark.slow
def test_run_prints_the_answer_then_the_summary_and_no_table(cli_outputs):
    out, _ = cli_outputs["short"]
    assert out.startswith("Name a planet.")
    assert "first token" in out and "tokens/s" in out and "decisions" in flat(out)
    assert not any(rule in out for rule in TABLE_RULES)
    assert_fits_80_columns(out)


@pytest.mark.slow
def test_run_report_full_and_v_print_the_tables_within_80_columns(cli_outputs):
    for name in ("full", "verbose"):
        out, _ = cli_outputs[name]
        assert "steps by mode" in out and "bake decisions" in out and "first token" in out
        assert_fits_80_columns(out)


@pytest.mark.slow
def test_progress_is_not_printed_when_stderr_is_not_a_terminal(cli_outputs):
    for _, err in cli_outputs.values():
        assert err == ""


def test_unknown_report_kind_is_one_error_line(capsys):
    assert main(["run", "--report", "long", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--report" in err and "long" in err


# -- progress -------------------------------------------------------------------------------------

class _Terminal:
    """Progress listeners that believe stderr is a terminal, drawing into ``out``."""

    def __init__(self):
        self.out = io.StringIO()
        self.made = []

    def patch(self, monkeypatch):
        import fuel.cli.progress as progress

        real = progress.BuildProgress
        terminal = self

        class Recording(real):
            def __init__(self, console=None, *, enabled=True):
                super().__init__(Console(file=terminal.out, force_terminal=True, width=120),
                                 enabled=enabled)
                terminal.made.append(self)

        monkeypatch.setattr(progress, "BuildProgress", Recording)


def test_a_terminal_sees_the_conversion_and_the_program_builds(tmp_path, monkeypatch):
    from tests.runtime.conftest import write_tiny_gguf

    dims = {"hidden": 64, "ffn": 128, "heads": 2, "kv_heads": 1, "head_dim": 32}
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", quantize={"ffn_down.weight": "Q8_0"}, dims=dims)
    monkeypatch.setenv("FUEL_CACHE_DIR", str(tmp_path / "cache"))
    terminal = _Terminal()
    terminal.patch(monkeypatch)
    assert main(["run", str(tiny.path), "--raw", "-p", "ab", "-n", "2", "--threads", "1",
                 "--no-jit", "--no-program-cache"]) == 0
    (listener,) = terminal.made
    assert any(d.startswith("converting tiny.gguf (stored formats") for d in listener.opened)
    assert any(d.startswith("building program prefill") for d in listener.opened)
    drawn = terminal.out.getvalue()
    assert "converting tiny.gguf" in drawn and "building program" in drawn
    assert not listener._progress.live.is_started


def test_json_runs_draw_no_progress_even_on_a_terminal(tmp_path, monkeypatch, capsys):
    from tests.runtime.conftest import write_tiny_gguf

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("FUEL_CACHE_DIR", str(tmp_path / "cache"))
    terminal = _Terminal()
    terminal.patch(monkeypatch)
    assert main(["run", str(tiny.path), "--raw", "-p", "ab", "-n", "2", "--threads", "1",
                 "--no-jit", "--no-program-cache", "--json"]) == 0
    json.loads(capsys.readouterr().out)
    (listener,) = terminal.made
    assert listener.opened  # the tasks were reported ...
    assert terminal.out.getvalue() == ""  # ... and nothing was drawn


class _Recorder:
    """A :class:`fuel.progress.Listener` keeping every description a task showed."""

    def __new__(cls):
        from fuel.progress import Listener, Task

        class Recorder(Listener):
            def __init__(self):
                self.shown: list[str] = []
                self.open = 0

            def task(self, description, total=None):
                recorder = self
                recorder.shown.append(description)
                recorder.open += 1

                class Shown(Task):
                    def update(self, *, completed=None, total=None, description=None):
                        if description is not None:
                            recorder.shown.append(description)

                    def close(self):
                        recorder.open -= 1

                return Shown()

        return Recorder()


def test_jit_compilation_and_judge_measurement_report_which_kernel_n_of_m(tmp_path):
    from fuel.cost import device
    from fuel.jit.session import JitSession
    from fuel.kernels import cpu_table
    from fuel.optimize import OptimizeOptions
    from fuel.optimize.optimize import offer_arms
    from fuel.progress import listening
    import torch

    from tests.jit.test_shape_gate import RIGHT, WrongAtSomeWidths, residual_step

    session = JitSession(table=cpu_table(), synthesizer=WrongAtSomeWidths(0),
                         store_path=tmp_path / "judge.sqlite",
                         profile_options={"warmup": 0, "repeats": 1, "min_sample_ns": 0})
    graph, root = residual_step(RIGHT)
    recorder = _Recorder()
    with listening(recorder):
        session.adopt_for(graph, [root])
        offered = offer_arms(graph, [root], OptimizeOptions(
            table=session.table, runtime=session.registry, runtime_gate=session.gate(),
            device_spec=device("h100-sxm")))
        feeds = {"x": torch.randn(1, RIGHT), "r": torch.randn(1, RIGHT),
                 "gain": torch.randn(RIGHT)}
        rows = session.measure(graph, offered.branches(), feeds)
    assert rows
    assert "JIT: compiling and verifying residual_add_rms_norm (1 of 1)" in recorder.shown
    timed = [d for d in recorder.shown if d.startswith("Judge: timing ")]
    assert timed[-1].endswith(f"({len(rows)} of {len(rows)})")
    # the adopted kernel's cell is named by its region, not its jit:<hash>
    assert any(d.startswith("Judge: timing residual_add_rms_norm") for d in timed)
    assert recorder.open == 0
