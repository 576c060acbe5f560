"""`fuel serve` option errors: one line, exit status 2, before any model is loaded."""

from __future__ import annotations

from fuel.cli.app import main


def test_an_unknown_drafter_is_one_error_line_and_status_2(capsys):
    assert main(["serve", "--drafter", "oracle", "--speculate", "2"]) == 2
    err = capsys.readouterr().err
    assert "drafter" in err and "oracle" in err and "Traceback" not in err


def test_a_missing_model_file_is_one_error_line_and_status_2(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing.gguf"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "missing.gguf" in err and "Traceback" not in err


def test_serve_is_registered_with_its_options(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--host", "--port", "--max-batch", "--max-context", "--token-budget", "--api-key",
                   "--speculate"):
        assert option in out
