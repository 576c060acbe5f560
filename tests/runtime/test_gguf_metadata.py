"""A GGUF whose metadata holds a hostile value (a key of the wrong type, a head count of 0,
kv heads that do not divide the heads, a token list that disagrees with its types or merges):
``fuel run`` answers one error line naming the file and the GGUF key, before any tensor is
read, never a traceback (ZeroDivisionError, a reshape error, the tokenizers library's bare
Exception) and never a silently truncated value."""

from __future__ import annotations

import pytest

from fuel.cli import main
from tests.runtime.conftest import write_tiny_gguf

CASES = {
    # method the writer calls -> (what it writes instead, the error line's key and detail)
    "block_count_float": ("add_block_count", lambda s, o, v: s.add_float32("llama.block_count", 2.5),
                          r"llama\.block_count`: is 2\.5 \(float\), not an integer"),
    "block_count_string": ("add_block_count", lambda s, o, v: s.add_string("llama.block_count", "two"),
                           r"llama\.block_count`: is 'two' \(str\), not an integer"),
    "head_count_zero": ("add_head_count", lambda s, o, v: o(s, 0),
                        r"llama\.attention\.head_count`: \(config `num_attention_heads`\) is `0`"),
    "kv_heads_not_dividing": ("add_head_count_kv", lambda s, o, v: o(s, 3),
                              r"llama\.attention\.head_count_kv`: .*divisor"),
    "kv_heads_zero": ("add_head_count_kv", lambda s, o, v: o(s, 0),
                      r"llama\.attention\.head_count_kv`: .*positive integer"),
    "embedding_zero": ("add_embedding_length", lambda s, o, v: o(s, 0),
                       r"llama\.embedding_length`: .*positive integer"),
    "token_list_short": ("add_token_list", lambda s, o, v: o(s, v[: len(v) // 2]),
                         r"tokenizer\.ggml\.token_type`: expected one type per token"),
    "token_types_short": ("add_token_types", lambda s, o, v: o(s, v[:3]),
                          r"tokenizer\.ggml\.token_type`: expected one type per token \(\d+\), got 3"),
    "merge_without_space": ("add_token_merges", lambda s, o, v: o(s, ["nospace", *v]),
                            r"tokenizer\.ggml\.merges`: merge 0 \('nospace'\) is not two tokens"),
    "merge_of_unknown_tokens": ("add_token_merges", lambda s, o, v: o(s, ["zz qq", *v]),
                                r"tokenizer\.ggml\.merges`: the BPE tokenizer does not build: .*zz"),
    "bos_id_string": ("add_bos_token_id", lambda s, o, v: s.add_string("tokenizer.ggml.bos_token_id", "1"),
                      r"tokenizer\.ggml\.bos_token_id`: is '1' \(str\), not an integer"),
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUEL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_gguf_metadata_is_one_error_naming_the_key(case, tmp_path, capsys, monkeypatch):
    import re

    import gguf

    method, write, expected = CASES[case]
    original = getattr(gguf.GGUFWriter, method)
    monkeypatch.setattr(gguf.GGUFWriter, method,
                        lambda self, value, *a, **k: write(self, original, value))
    path = tmp_path / f"{case}.gguf"
    write_tiny_gguf(path, chat_template="{{ messages[0]['content'] }}")
    monkeypatch.setattr(gguf.GGUFWriter, method, original)
    status = main(["run", str(path), "-n", "2", "-p", "ab", "--dtype", "f32", "--no-jit",
                   "--max-context", "32"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {path}: key `"), line
    assert re.search(expected, line), line
    weights = tmp_path / "cache" / "weights"  # nothing converted, nothing half-written
    assert not weights.exists() or not any(weights.iterdir())
