"""The converted-weights cache survives faults: a killed conversion, bytes changed on disk, a
read-only or full cache folder, concurrent conversions.

Each test asserts the outcome a user sees: the next run works (and cleans up) or refuses with
one line naming the folder; a damaged cache is never used; nothing half-written is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fuel.runtime.cache_integrity import MANIFEST, CacheCorrupt, clean_stale_staging, verify
from fuel.runtime.weights import CacheWriteError, convert_gguf, load_weights
from tests.runtime.conftest import write_tiny_gguf

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _leftovers(cache: Path) -> list[str]:
    weights = cache / "weights"
    return sorted(p.name for p in weights.iterdir()) if weights.exists() else []


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def test_a_conversion_killed_mid_write_is_cleaned_up_by_the_next_run(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        import fuel.runtime.weights as w
        real = w._save_safetensors
        def slow(tensors, target, *, source):
            real(tensors, target, source=source)
            Path({str(ready)!r}).write_text("x")
            time.sleep(600)
        w._save_safetensors = slow
        w.convert_gguf(Path({str(model.path)!r}), cache=Path({str(cache)!r}), progress=False)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], env=_env())
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert writer.poll() is None and time.monotonic() < deadline, "writer did not start"
            time.sleep(0.05)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(30)
    finally:
        if writer.poll() is None:
            writer.kill()
    staged = _leftovers(cache)
    assert len(staged) == 1 and staged[0].startswith("."), staged  # the killed writer's staging

    folder = convert_gguf(model.path, cache=cache, progress=False)
    assert _leftovers(cache) == [folder.name]
    verify(folder)


def test_a_live_writers_staging_folder_is_not_removed(tmp_path):
    from fuel.runtime.cache_integrity import staging

    with staging(tmp_path, "x") as stage:
        assert clean_stale_staging(tmp_path, "x") == []
        assert stage.exists()
    assert not stage.exists()


def _flip(path: Path, at: float = 0.6, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    for i in range(start, start + count):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_bytes_changed_in_a_finished_cache_are_detected_and_rebuilt(tmp_path, capfd):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    good = load_weights(model.path, cache=cache, progress=False)
    reference = {name: tensor.clone() for name, tensor in good.tensors.items()}
    target = good.source.folder / "model.safetensors"
    size = target.stat().st_size
    _flip(target)
    assert target.stat().st_size == size
    with pytest.raises(CacheCorrupt, match="checksum differs"):
        verify(good.source.folder)

    again = load_weights(model.path, cache=cache, progress=False)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cache is damaged" in err[0] and "rebuilding" in err[0]
    assert set(again.tensors) == set(reference)
    for name, tensor in reference.items():
        assert again[name].equal(tensor), name
    verify(again.source.folder)
    assert _leftovers(cache) == [again.source.folder.name]


def test_a_cache_without_a_manifest_is_never_trusted(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = convert_gguf(model.path, cache=tmp_path / "cache", progress=False)
    (folder / MANIFEST).unlink()
    with pytest.raises(CacheCorrupt, match="no checksum manifest"):
        verify(folder)
    rebuilt = convert_gguf(model.path, cache=tmp_path / "cache", progress=False)
    verify(rebuilt)


def test_a_healthy_read_only_cache_serves_runs(tmp_path, small_fs):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = load_weights(model.path, cache=small_fs.path, progress=False)
    small_fs.make_read_only()
    again = load_weights(model.path, cache=small_fs.path, progress=False)
    assert again.source.folder == first.source.folder
    assert all(again[n].equal(first[n]) for n in first.tensors)


def test_a_damaged_read_only_cache_is_refused_in_one_line_never_used(tmp_path, small_fs, capsys,
                                                                    monkeypatch):
    from fuel.cli.app import main

    model = write_tiny_gguf(tmp_path / "tiny.gguf", chat_template="{{ messages[0]['content'] }}")
    folder = convert_gguf(model.path, cache=small_fs.path, progress=False)
    _flip(folder / "model.safetensors")
    small_fs.make_read_only()
    monkeypatch.setenv("FUEL_CACHE_DIR", str(small_fs.path))
    status = main(["run", str(model.path), "--dtype", "f32", "--no-jit", "-n", "2", "-p", "ab"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == 2
    assert len(lines) == 1 and "cache is damaged" in lines[0] and "model.safetensors" in lines[0]
    assert captured.out == ""  # nothing generated from the damaged weights


def test_converting_into_a_read_only_cache_is_one_line(tmp_path, small_fs):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    small_fs.make_read_only()
    with pytest.raises(CacheWriteError) as error:
        convert_gguf(model.path, cache=small_fs.path / "c", progress=False)
    assert "\n" not in str(error.value) and "cannot write the weights cache" in str(error.value)
    small_fs.make_writable()
    assert not (small_fs.path / "c").exists() or _leftovers(small_fs.path / "c") == []


def test_a_full_disk_during_conversion_leaves_nothing_half_written(tmp_path, small_fs):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = small_fs.path / "cache"
    (cache / "weights").mkdir(parents=True)
    with small_fs.full():
        with pytest.raises(CacheWriteError) as error:
            convert_gguf(model.path, cache=cache, progress=False)
    assert "\n" not in str(error.value)
    assert _leftovers(cache) == []
    folder = convert_gguf(model.path, cache=cache, progress=False)  # room again: it works
    verify(folder)


def test_concurrent_conversions_end_with_one_complete_cache(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    script = (f"from pathlib import Path; import fuel.runtime.weights as w; "
              f"print(w.convert_gguf(Path({str(model.path)!r}), cache=Path({str(cache)!r}), progress=False))")
    procs = [subprocess.Popen([sys.executable, "-c", script], env=_env(), stdout=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(set(outs)) == 1
    folder = Path(outs[0])
    assert _leftovers(cache) == [folder.name]
    verify(folder)


def test_flipped_bytes_in_a_stored_format_cache_are_caught_and_rebuilt(tmp_path, capsys):
    # Why: the stored-format (packed) cache is a second cache writer; it must record and verify
    # checksums like the f32 one, never load damaged packed blocks.
    from fuel.runtime.quant_cache import convert_gguf_stored, load_stored

    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = convert_gguf_stored(model.path, cache=tmp_path / "cache")
    assert (folder / "INTEGRITY.json").is_file()
    _flip(folder / "model.safetensors")
    with pytest.raises(CacheCorrupt):
        verify(folder)
    weights = load_stored(model.path, cache=tmp_path / "cache", progress=False)
    assert "cache is damaged" in capsys.readouterr().err
    verify(folder)  # the rebuilt folder matches its fresh checksums
    assert weights.dtype.value == "stored"
