"""Shared inputs of the bad-input corpus: a tiny runnable checkpoint folder (a 2-layer llama
converted from a synthetic GGUF) and a healthy Judge store, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


def make_shared(root: Path) -> dict[str, Path]:
    from fuel.cost.store import JudgeStore, StoredMeasurement
    from fuel.runtime.weights import convert_gguf
    from tests.runtime.conftest import write_tiny_gguf

    root.mkdir(parents=True, exist_ok=True)
    gguf = write_tiny_gguf(root / "tiny.gguf",
                           chat_template="{% for m in messages %}<|im_start|>{{ m['content'] }}"
                                         "<|im_end|>{% endfor %}").path
    folder = convert_gguf(gguf, cache=root / "cache", progress=False)
    store = root / "store.sqlite"
    with JudgeStore.open(store) as judge:
        judge.record(StoredMeasurement("matmul", "f32", "s", "cpu", "k", "d", "l", 100, 1, 3))
    for extra in ("-wal", "-shm"):
        Path(str(store) + extra).unlink(missing_ok=True)
    return {"ckpt": folder, "store": store}


@pytest.fixture(scope="session")
def badinput_shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_shared(tmp_path_factory.mktemp("badinput-shared"))
