"""The console script holds Python's cyclic collector off while a ``fuel`` process starts
(``fuel.console``): off until a model-loading command has loaded its model, or until any other
command is dispatched; then the start-up objects are frozen and the collector runs again.

Each case runs in its own interpreter: the collector's state is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


def _run(body: str) -> dict:
    """Run ``body`` in a fresh interpreter; it prints one JSON object, returned here."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_planning_command_runs_with_the_collector_on_and_start_up_frozen():
    seen = _run("""
        import gc, json, sys
        import fuel.cli.app as app
        from fuel import console
        record = {}
        def fake_main(args):
            record.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count(), args=args)
            return 0
        app.main = fake_main
        sys.argv = ["fuel", "plan", "smollm2-135m"]
        status = console.main()
        print(json.dumps(dict(record, status=status, after=gc.isenabled())))
    """)
    assert seen["args"] == ["plan", "smollm2-135m"]
    assert seen["enabled"] is True and seen["frozen"] > 0
    assert seen["status"] == 0 and seen["after"] is True


@pytest.mark.parametrize("command", ["run", "demo"])
def test_a_run_loads_its_model_with_the_collector_off_and_generates_with_it_on(command):
    seen = _run(f"""
        import gc, json, sys
        import fuel.cli.run as run
        import fuel.runtime.model as model
        from fuel import console
        record = {{}}
        def fake_load(*args, **kwargs):
            record["loading"] = gc.isenabled()
            return object()
        def fake_generate(loaded, texts, **kwargs):
            record["generating"] = gc.isenabled()
            record["frozen"] = gc.get_freeze_count()
            return {{}}
        model.load_model = fake_load
        run._generate = fake_generate
        sys.argv = ["fuel", "{command}", "-n", "1"]
        status = console.main()
        print(json.dumps(dict(record, status=status, after=gc.isenabled())))
    """)
    assert seen["loading"] is False
    assert seen["generating"] is True and seen["frozen"] > 0
    assert seen["status"] == 0 and seen["after"] is True


def test_a_failed_start_still_re_enables_the_collector():
    seen = _run("""
        import gc, json, sys
        import fuel.runtime.model as model
        from fuel import console
        from fuel.errors import InputError
        def failing_load(*args, **kwargs):
            raise InputError("model.gguf", "weights", "missing")
        model.load_model = failing_load
        sys.argv = ["fuel", "run", "-n", "1"]
        status = console.main()
        print(json.dumps(dict(status=status, after=gc.isenabled())))
    """)
    assert seen == {"status": 2, "after": True}


def test_importing_fuel_or_calling_the_cli_in_process_leaves_the_collector_alone():
    seen = _run("""
        import gc, json
        from fuel import console
        from fuel.cli.app import main
        main(["--help"])
        console.startup_done()
        on = gc.isenabled()
        gc.disable()
        console.startup_done()   # a library user's own choice is kept
        print(json.dumps(dict(on=on, still_off=not gc.isenabled(), frozen=gc.get_freeze_count())))
    """)
    assert seen == {"on": True, "still_off": True, "frozen": 0}


def test_a_tensor_parallel_run_coordinates_with_the_collector_on():
    # `run --tp N` loads the model in its rank processes; the coordinating process must not keep
    # the collector off for the whole run.
    seen = _run("""
        import gc, json, sys
        import fuel.cli.run_parallel as parallel
        from fuel import console
        record = {}
        def fake_parallel(*args, **kwargs):
            record["coordinating"] = gc.isenabled()
        parallel.run_parallel = fake_parallel
        sys.argv = ["fuel", "run", "--tp", "2", "-n", "1"]
        status = console.main()
        print(json.dumps(dict(record, status=status)))
    """)
    assert seen == {"coordinating": True, "status": 0}


def test_a_warning_prints_as_one_line_naming_what_to_fix():
    """``fuel``'s warnings (an unreadable cache file it skips) print as one ``warning:`` line,
    without Python's echo of the source line that raised it."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys, warnings
        import fuel.cli.app as app
        from fuel import console
        def fake_main(args):
            warnings.warn("/x/probe.json: ignoring unreadable probe cache; re-probing")
            return 0
        app.main = fake_main
        sys.argv = ["fuel", "plan", "smollm2-135m"]
        sys.exit(console.main())
    """)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert out.stderr == "warning: /x/probe.json: ignoring unreadable probe cache; re-probing\n"
