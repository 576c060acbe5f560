"""The build progress line: drawn only on a terminal's stderr, gone once no build runs."""

from __future__ import annotations

import io

from rich.console import Console

from fuel.cli.progress import BuildProgress


def test_nothing_is_drawn_off_a_terminal_but_every_build_is_recorded():
    out = io.StringIO()
    progress = BuildProgress(Console(file=out, force_terminal=False))
    progress("decode rows=1 blocks=4", "start")
    progress("decode rows=1 blocks=4", "restored")
    assert out.getvalue() == ""
    assert progress.seen == [("decode rows=1 blocks=4", "start"),
                             ("decode rows=1 blocks=4", "restored")]


def test_a_terminal_sees_the_program_being_built_until_it_is_done():
    out = io.StringIO()
    progress = BuildProgress(Console(file=out, force_terminal=True, width=200))
    progress("prefill rows=41 blocks=4", "start")
    assert progress._progress.live.is_started
    progress("prefill rows=41 blocks=4", "built")
    assert not progress._progress.live.is_started
    assert "building program prefill rows=41 blocks=4" in out.getvalue()
