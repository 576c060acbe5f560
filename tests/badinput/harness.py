"""Runs one corpus case through the real CLI in-process and classifies what happened.

Decides the outcome kinds: ``clean`` (exit 2, exactly one stderr line that starts with
``error:`` and matches the case's regex, no traceback, nothing written, nothing printed on
stdout), ``traceback`` (an
exception escaped ``fuel.cli.app.main``), ``accepted`` (exit 0: bad input taken as good) and
``unclean`` (any other failure of those rules, with the reason).

Invariants: every case runs in its own folder with ``FUEL_CACHE_DIR`` pointing at an empty
folder inside it, so "nothing written" is checked over everything the command could touch; the
shared tiny checkpoint and Judge store are copied in, never used in place.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path

from tests.badinput.corpus import Case, Gen


@dataclass(frozen=True)
class Outcome:
    kind: str
    detail: str
    stderr: str


def _write(path: Path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, Gen):
        content.make(path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")


def prepare(case: Case, folder: Path, shared: dict[str, Path]) -> list[str]:
    """Write the case's files under ``folder``; return argv with placeholders filled."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cache").mkdir()
    for name, content in case.files:
        _write(folder / name, content)
    values = {"d": str(folder), "ckpt": str(folder / "ckpt"), "store": str(folder / "store.sqlite")}
    if case.ckpt is not None:
        shutil.copytree(shared["ckpt"], folder / "ckpt")
        for name, content in case.ckpt:
            target = folder / "ckpt" / name
            if content is None:
                target.unlink()
            elif isinstance(content, Gen) and target.exists() and content.label != "a directory":
                content.make(target)
            else:
                if target.exists():
                    target.unlink()
                _write(target, content)
    if any("{store}" in arg for arg in case.argv):
        shutil.copy(shared["store"], folder / "store.sqlite")
    return [arg.format(**values) if "{" in arg and "}" in arg and not arg.startswith("{%") else arg
            for arg in case.argv]


def snapshot(folder: Path) -> dict[str, tuple]:
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            st = p.lstat()
            out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


class ReachedRealWork(Exception):
    """A bad input got as far as loading the default model or measuring kernels: accepted."""


def _refuse_real_work(*args, **kwargs):
    raise ReachedRealWork("reached real work (default model / kernel campaign)")


@contextlib.contextmanager
def no_real_work():
    """Loading the default model (a 30 s conversion, minutes of decoding) or running a kernel
    campaign means the bad input was accepted: stop there instead of doing the work."""
    import fuel.cost.campaign as campaign
    import fuel.runtime.weights as weights

    saved = weights.default_model_path, campaign.run_campaign
    weights.default_model_path = campaign.run_campaign = _refuse_real_work
    try:
        yield
    finally:
        weights.default_model_path, campaign.run_campaign = saved


def run_case(case: Case, folder: Path, shared: dict[str, Path]) -> Outcome:
    from fuel.cli.app import main

    argv = prepare(case, folder, shared)
    before = snapshot(folder)
    out, err = io.StringIO(), io.StringIO()
    saved_env = os.environ.get("FUEL_CACHE_DIR")
    saved_cwd = os.getcwd()
    os.environ["FUEL_CACHE_DIR"] = str(folder / "cache")
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), no_real_work():
            try:
                status = main(argv)
            except SystemExit as done:
                status = done.code
            except ReachedRealWork:
                return Outcome("accepted", "reached real work", err.getvalue())
            except Exception:  # noqa: BLE001 — what escaped is the finding
                return Outcome("traceback", traceback.format_exc(limit=-3).strip().splitlines()[-1],
                               err.getvalue())
    finally:
        os.chdir(saved_cwd)
        if saved_env is None:
            os.environ.pop("FUEL_CACHE_DIR", None)
        else:
            os.environ["FUEL_CACHE_DIR"] = saved_env
    text = err.getvalue()
    lines = [line for line in text.splitlines() if line.strip()]
    if status == 0:
        return Outcome("accepted", "exit 0", text)
    if "Traceback" in text:
        return Outcome("traceback", "traceback on stderr", text)
    problems = []
    if status != 2:
        problems.append(f"exit {status}")
    if len(lines) != 1:
        problems.append(f"{len(lines)} stderr lines")
    elif not lines[0].startswith("error: "):
        problems.append("line does not start with `error: `")
    elif not re.search(case.expect, lines[0]):
        problems.append(f"line does not match /{case.expect}/")
    after = snapshot(folder)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        problems.append(f"wrote {', '.join(changed[:4])}")
    if out.getvalue().strip():  # e.g. `fuel run` echoing the prompt it then refuses
        problems.append(f"printed on stdout: {out.getvalue().strip()[:80]!r}")
    if problems:
        return Outcome("unclean", "; ".join(problems), text)
    return Outcome("clean", "", text)
