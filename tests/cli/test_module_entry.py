"""``python -m fuel`` is the ``fuel`` command: same output, same exit statuses."""

import json
import subprocess
import sys

from fuel.cli import main


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fuel", *args], capture_output=True, text=True,
                          timeout=120)


def test_python_dash_m_fuel_prints_what_the_console_script_prints(capsys):
    assert main(["models", "--json"]) == 0
    in_process = json.loads(capsys.readouterr().out)
    done = run_module("models", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == in_process


def test_python_dash_m_fuel_exits_2_with_one_line_on_bad_input():
    done = run_module("circuit", "describe", "no-such-model")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-model" in lines[0], done.stderr
