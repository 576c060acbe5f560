"""The root of fuel's typed errors.

Every malformed input raises one subclass of :class:`FuelError` whose message names what to fix
(file, key, value). The CLI turns any ``FuelError`` into one line on stderr and a non-zero exit;
anything else escaping to the CLI is a bug in fuel, not the user's input.

Ordinary "no" answers (no kernel, no match, a tie) are never errors: they are typed values with a
reason, defined next to the decision that returns them.
"""

from __future__ import annotations


class FuelError(Exception):
    """Base class for errors a user can act on."""


class InputError(FuelError):
    """A malformed input file or value.

    ``file`` is the path (or a description such as ``"--set"``), ``key`` the offending key in
    dotted form, and ``detail`` what is wrong with it. The message always names all three that
    are known.
    """

    def __init__(self, file: str | None, key: str | None, detail: str):
        self.file = file
        self.key = key
        self.detail = detail
        where = ": ".join(part for part in (file, f"key `{key}`" if key else None) if part)
        super().__init__(f"{where}: {detail}" if where else detail)
