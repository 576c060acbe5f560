"""What verifying the weights cache costs: the checksum pass over SmolLM2-135M's converted
cache (``fuel.runtime.cache_integrity.verify``, xxh3_128) against reading the same tensors
(safetensors load), and against a blake2b pass for scale.

Usage: .venv/bin/python benchmarks/run.py cache_integrity   (converts the default model into
``$FUEL_CACHE_DIR`` first if needed). Best of 3 each, files warm in the page cache.
"""

from __future__ import annotations

import hashlib
import time


def best(action, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    from safetensors.torch import load_file

    from fuel.runtime.cache_integrity import verify
    from fuel.runtime.weights import load_weights

    folder = load_weights(progress=True).source.folder
    tensors = folder / "model.safetensors"
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())

    def blake2b() -> None:
        digest = hashlib.blake2b(digest_size=32)
        with tensors.open("rb") as stream:
            while chunk := stream.read(1 << 24):
                digest.update(chunk)

    verify_s = best(lambda: verify(folder))
    load_s = best(lambda: load_file(str(tensors)))
    blake_s = best(blake2b)
    print(f"cache {folder} ({size / 1e6:,.0f} MB)")
    print(f"verify (xxh3_128, every file): {verify_s:.3f} s  ({size / verify_s / 1e9:.2f} GB/s)")
    print(f"safetensors load_file:         {load_s:.3f} s")
    print(f"blake2b over model.safetensors: {blake_s:.3f} s")
    print(f"verify / load = {verify_s / load_s:.2f}x; blake2b / xxh3 = {blake_s / verify_s:.1f}x")


if __name__ == "__main__":
    main()
