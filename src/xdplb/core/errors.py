"""One exception hierarchy for xdplb.

Errors from the kernel keep their errno; load failures keep the verifier log;
configuration errors name the field at fault.
"""

from __future__ import annotations

import errno as _errno
import os


class XdplbError(Exception):
    """Base of every error xdplb raises on purpose."""


class BpfError(XdplbError):
    """A bpf syscall or libbpf call failed."""

    def __init__(self, what: str, err: int, log: str = "") -> None:
        self.what = what
        self.errno = abs(err)
        self.log = log
        name = _errno.errorcode.get(self.errno, str(self.errno))
        super().__init__(f"{what}: {name} ({os.strerror(self.errno)})")


class LoadError(BpfError):
    """An object or program failed to load; ``log`` holds the verifier/libbpf log."""

    def __str__(self) -> str:
        base = super().__str__()
        if not self.log:
            return base
        tail = "\n".join(self.log.rstrip().splitlines()[-40:])
        return f"{base}\n--- libbpf/verifier log (last lines) ---\n{tail}"


class ConfigError(XdplbError):
    """A configuration was refused; ``field`` is the dotted path of the culprit."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class LabError(XdplbError):
    """The network-namespace lab could not be built or torn down."""
