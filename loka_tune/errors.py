"""Error types shared by every layer of loka-tune.

Every user-facing error names the problem, the offending value and the fix. Internal
invariants use ``assert``; everything a user can cause raises one of these.
"""

from __future__ import annotations

__all__ = [
    "LokaError",
    "ConfigError",
    "DataError",
    "BackendError",
    "UnsupportedChoiceError",
    "ProbeError",
    "StudyError",
    "ModError",
    "ServingError",
]


class LokaError(Exception):
    """Base class of every error loka-tune raises on purpose."""


class ConfigError(LokaError, ValueError):
    """A precision config, choice string or study file is malformed.

    ``key`` names the offending field (dotted path) where one is known, ``path`` the file it is
    in (a study or precision-config file): ``str(e)`` is ``"path: key: message"``.
    """

    def __init__(self, message: str, *, key: str | None = None, path: str | None = None) -> None:
        self.key = key
        self.path = path
        self.message = message
        where = "".join(f"{w}: " for w in (path, key) if w)
        super().__init__(where + message)

    def in_file(self, path: object) -> ConfigError:
        """This error naming the file ``path`` (unchanged if it names a file already)."""
        if self.path is not None:
            return self
        return ConfigError(self.message, key=self.key, path=str(path))


class DataError(LokaError, ValueError):
    """A data file or data source is unusable; names the file and line where known."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        self.path = path
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


class BackendError(LokaError, RuntimeError):
    """A kernel backend is missing, broken or cannot run here."""


class UnsupportedChoiceError(BackendError, ValueError):
    """A backend was asked for a GEMM choice it does not support."""


class ProbeError(LokaError, ValueError):
    """The probe cannot run or its statistics are unusable."""


class ModError(LokaError, ValueError):
    """A model adaptation (Mod) cannot be applied as asked."""


class ServingError(LokaError, ValueError):
    """A model's serving form is used as it cannot be: trained, applied again, or given a batch
    outside every bucket of its serving plan. The message names the fix."""


class StudyError(LokaError, ValueError):
    """A tuning study cannot run as configured."""
