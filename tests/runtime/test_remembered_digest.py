"""A model file's digest (its conversion's cache key) is remembered by the file's identity, so a
warm load does not hash the whole model again; any change to the file, or a damaged memo, makes
it hash the file again."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from fuel.runtime import cache_integrity
from fuel.runtime.cache_integrity import remembered_digest


@pytest.fixture
def settled(tmp_path, monkeypatch):
    """A model file last changed long enough ago to be remembered, and a counter of hashings."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    monkeypatch.setattr(cache_integrity, "_MEMO_SETTLED_NS", 0)
    hashed = []
    real = cache_integrity.file_digest
    monkeypatch.setattr(cache_integrity, "file_digest",
                        lambda p, digest=None: hashed.append(Path(p)) or real(p, digest))
    return path, tmp_path / "digests", hashed


def test_a_second_load_reads_the_memo_not_the_file(settled):
    path, memo, hashed = settled
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    assert remembered_digest(path, memo) == expected and len(hashed) == 1
    assert remembered_digest(path, memo) == expected and len(hashed) == 1
    assert [p.suffix for p in memo.iterdir()] == [".json"]  # no staging file left behind


def test_a_file_rewritten_with_the_same_size_is_hashed_again(settled):
    path, memo, hashed = settled
    remembered_digest(path, memo)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    time.sleep(0.01)
    path.write_bytes(bytes(data))  # same size; its change time moves
    assert remembered_digest(path, memo) == hashlib.sha256(bytes(data)).hexdigest()
    assert len(hashed) == 2
    assert len(list(memo.iterdir())) == 1  # the changed file's memo replaced the old one
    assert remembered_digest(path, memo) and len(hashed) == 2


def test_a_file_changed_just_now_is_hashed_every_time(settled, monkeypatch):
    # A rewrite within the file system's timestamp granularity could keep size and times.
    path, memo, hashed = settled
    monkeypatch.setattr(cache_integrity, "_MEMO_SETTLED_NS", 10**12)
    remembered_digest(path, memo)
    remembered_digest(path, memo)
    assert len(hashed) == 2 and not memo.exists()


@pytest.mark.parametrize("damage", ["{not json", '{"identity": [], "digest": "ab"}', '{"digest": 3}', ""])
def test_a_damaged_memo_is_ignored_and_replaced(settled, damage):
    path, memo, hashed = settled
    remembered_digest(path, memo)
    (entry,) = memo.iterdir()
    entry.write_text(damage)
    assert remembered_digest(path, memo) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(hashed) == 2
    assert remembered_digest(path, memo) and len(hashed) == 2  # rewritten whole


def test_a_cache_folder_that_cannot_be_written_only_loses_the_memo(settled):
    path, memo, hashed = settled
    memo.parent.joinpath("blocked").write_text("")
    blocked = memo.parent / "blocked" / "digests"  # under a file: mkdir fails
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    assert remembered_digest(path, blocked) == expected
    assert remembered_digest(path, blocked) == expected and len(hashed) == 2
    assert not any(name.endswith(".tmp") for name in os.listdir(memo.parent))
