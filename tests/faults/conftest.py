"""Fault fixtures: small file systems that can be made read-only or full.

A tmpfs is mounted where the test runs as root and the kernel allows it (the real thing: a
read-only remount gives EROFS even to root, a tiny size gives ENOSPC). Elsewhere the same
faults are simulated: read-only by ``chmod`` (which binds a non-root user), full by a file-size
limit (``RLIMIT_FSIZE``: a write past it fails with EFBIG, as a full disk fails with ENOSPC).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@dataclass
class SmallFs:
    path: Path
    mounted: bool

    def make_read_only(self) -> None:
        if self.mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)
        else:
            for root, dirs, files in os.walk(self.path):
                for name in files:
                    os.chmod(Path(root) / name, 0o444)
                os.chmod(root, 0o555)

    def make_writable(self) -> None:
        if self.mounted:
            subprocess.run(["mount", "-o", "remount,rw", str(self.path)], check=True)
        else:
            for root, dirs, files in os.walk(self.path):
                os.chmod(root, 0o755)

    @contextlib.contextmanager
    def full(self) -> Iterator[None]:
        """The file system has (almost) no room while the block runs."""
        if self.mounted:
            filler = self.path / ".filler"
            fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o644)
            try:
                for size in (1 << 16, 4096, 512, 1):
                    try:
                        while True:
                            os.write(fd, b"\0" * size)
                    except OSError:
                        pass
            finally:
                os.close(fd)
            try:
                yield
            finally:
                filler.unlink()
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, previous)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[SmallFs]:
    path = tmp_path / "fs"
    mounted = _mount_tmpfs(path, "4m")
    path.mkdir(exist_ok=True)
    fs = SmallFs(path, mounted)
    try:
        yield fs
    finally:
        if mounted:
            _umount(path)
        else:
            fs.make_writable()
