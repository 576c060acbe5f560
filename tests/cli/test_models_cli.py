"""``fuel models`` (``fuel demo`` runs the model: tests/cli/test_run_cli.py)."""

import json

from fuel.cli import main


def test_models_json_lists_every_zoo_model_with_its_dims(capsys):
    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["llama-3.1-70b"]["layers"] == 80 and rows["llama-3.1-70b"]["kv_heads"] == 8
    assert rows["mixtral-8x7b"]["experts"] == 8 and rows["mixtral-8x7b"]["top_k"] == 2
    assert rows["smollm2-135m"]["params"] == 134_515_008


def test_models_table_shows_heads_and_params(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b" in out and "32/4" in out and "8 of 128" in out and "8.03B" in out
