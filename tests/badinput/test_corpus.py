"""Every bad input in the corpus prints one error line naming what to fix and exits 2.

One parametrized test runs the real CLI (``fuel.cli.app.main``, in-process) on each case of
:mod:`tests.badinput.corpus` and asserts: exit status 2, exactly one line on stderr, starting
``error:`` and matching the case's regex, no traceback, nothing written (the case folder and
the cache folder are unchanged). A few cases also run through the installed ``fuel`` script in
a subprocess, so the console-script path is covered too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.badinput.corpus import CASES, Case
from tests.badinput.harness import prepare, run_case, snapshot




def test_corpus_is_large_and_covers_every_command():
    assert len(CASES) >= 300
    commands = {" ".join(c.argv[:2]) if c.argv[0] in ("circuit", "judge") else c.argv[0] for c in CASES}
    for command in ("models", "circuit describe", "circuit show", "plan", "devices", "judge show",
                    "judge export", "judge import", "judge clear", "judge profile", "explain",
                    "jit", "run", "demo"):
        assert command in commands, command


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clean_line(case: Case, tmp_path: Path, badinput_shared):
    outcome = run_case(case, tmp_path / "case", badinput_shared)
    assert outcome.kind == "clean", f"{outcome.kind}: {outcome.detail}\n{outcome.stderr}"


SUBPROCESS_SAMPLE = ("unknown-command-bogus", "run-batch-below", "config-binary-describe",
                     "table-arabic-digits-show", "prompt-invalid-utf8")


@pytest.mark.parametrize("case_id", SUBPROCESS_SAMPLE)
def test_console_script_prints_the_same_one_line(case_id: str, tmp_path: Path, badinput_shared):
    case = next(c for c in CASES if c.id == case_id)
    folder = tmp_path / "case"
    argv = prepare(case, folder, badinput_shared)
    before = snapshot(folder)
    env = {**os.environ, "FUEL_CACHE_DIR": str(folder / "cache"),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    # Undecodable bytes reach a real process as bytes (Python hands them on as surrogates).
    args = [a.encode("utf-8", "surrogateescape") for a in argv]
    script = "import sys; from fuel.cli import main; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          env=env, cwd=folder, timeout=120)
    lines = done.stderr.decode("utf-8", "replace").splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert re.search(case.expect, lines[0]), lines[0]
    assert b"Traceback" not in done.stderr
    assert snapshot(folder) == before
