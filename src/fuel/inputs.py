"""Reading user input files and writing user-named outputs: the one place where OS and
decoding failures become typed errors.

Decides how a file the user named is read and how an output path is checked and written:

- ``read_text`` reads UTF-8 text; a missing file, a directory, an unreadable file, a file in
  another encoding (UTF-16 is recognized by its byte-order mark) or with undecodable bytes
  raises the caller's error type naming the file (and the byte offset of the first bad byte).
- ``parse_json`` / ``parse_toml`` parse text; malformed text and absurd nesting
  (``RecursionError``) or sizes (``MemoryError``) raise the caller's error naming the file.
- ``check_output_path`` checks, before any work starts, that an output file can be created:
  its folder exists and is a folder, the path is not a folder.
- ``write_atomically`` writes via a temporary file in the same folder and a rename: a full
  disk or read-only folder raises :class:`~fuel.errors.InputError` naming the path, and leaves
  neither a half-written nor a 0-byte file, nor the temporary file.

Invariants: the error types are the callers' (``fail(detail)`` builds them), so each loader
keeps its own typed error; only ``OSError``, ``UnicodeDecodeError``, ``RecursionError``,
``MemoryError`` and the parsers' own errors are converted, nothing else.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuel.errors import FuelError, InputError

Fail = Callable[[str], FuelError]

_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
         (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def os_reason(error: OSError) -> str:
    """A short reason for an OS error (``is a directory``, ``no such file``...)."""
    if isinstance(error, IsADirectoryError):
        return "is a directory, not a file"
    if isinstance(error, FileNotFoundError):
        return "no such file"
    if isinstance(error, NotADirectoryError):
        return "a parent in the path is not a directory"
    if error.errno == errno.ENOSPC:
        return "no space left on the device"
    if error.errno == errno.EROFS:
        return "read-only file system"
    return (error.strerror or str(error)).lower()


def decode_utf8(data: bytes, fail: Fail) -> str:
    """``data`` as UTF-8 text (a UTF-8 byte-order mark is dropped)."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            return _raise(fail(f"not valid UTF-8: the file is {name} (save it as UTF-8)"))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        bad = data[error.start:error.start + 1].hex()
        return _raise(fail(f"not valid UTF-8: byte 0x{bad} at offset {error.start}"))


def read_bytes(path: Path, fail: Fail) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        return _raise(fail(f"cannot read: {os_reason(error)}"))
    except MemoryError:
        return _raise(fail("cannot read: the file is too large"))


def read_text(path: Path, fail: Fail) -> str:
    """The UTF-8 text of ``path``; every failure is ``fail(detail)``."""
    return decode_utf8(read_bytes(path, fail), fail)


def _parse(loads: Callable[[str], Any], syntax_error: type[Exception], kind: str, text: str,
           fail: Fail) -> Any:
    try:
        return loads(text)
    except syntax_error as error:
        return _raise(fail(f"not valid {kind}: {error}"))
    except ValueError as error:  # an integer of 4,300+ digits (int-from-string limit)
        return _raise(fail(f"not valid {kind}: {error}"))
    except RecursionError:
        return _raise(fail(f"not valid {kind}: nested too deeply"))
    except MemoryError:
        return _raise(fail(f"not valid {kind}: too large to parse"))


def parse_json(text: str, fail: Fail) -> Any:
    return _parse(json.loads, json.JSONDecodeError, "JSON", text, fail)


def parse_toml(text: str, fail: Fail) -> Any:
    import tomllib

    return _parse(tomllib.loads, tomllib.TOMLDecodeError, "TOML", text, fail)


def load_json(path: Path, fail: Fail) -> Any:
    return parse_json(read_text(path, fail), fail)


def check_output_path(path: Path, option: str) -> Path:
    """Refuse (before any work) an output path whose file cannot be created."""
    path = Path(path)
    if not str(path) or str(path) == ".":
        raise InputError("command line", option, "an empty path (name the file to write)")
    if path.is_dir():
        raise InputError(str(path), option, "is a directory (name a file to write)")
    parent = path.parent
    for folder in (parent, *parent.parents):
        if folder.exists():
            if not folder.is_dir():
                raise InputError(str(path), option, f"{folder} is not a directory")
            break
    if not parent.is_dir():
        raise InputError(str(path), option, f"the folder {parent} does not exist")
    return path


def write_atomically(path: Path, data: str | bytes, option: str | None = None) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and a rename."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    except OSError as error:
        raise InputError(str(path), option, f"cannot write: {os_reason(error)}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(str(path), option, f"cannot write: {os_reason(error)}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _raise(error: FuelError):
    raise error from None
