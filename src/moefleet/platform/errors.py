"""Errors raised by the platform layer (catalog, billing, object storage).

All are :class:`~moefleet.errors.MoefleetError`, so the CLI reports them as
``error: ...`` / ``hint: ...`` without a traceback.
"""

from __future__ import annotations

from moefleet.errors import DataError, MoefleetError


class PlatformError(MoefleetError):
    """A request the platform cannot honour: bad memory size, negative duration, ..."""


class PlatformConfigError(DataError):
    """A platform YAML file that is unreadable or fails validation (names file and field)."""


class InvalidMemoryError(PlatformError):
    """A memory size (MB) that the platform does not offer."""


class StorageError(MoefleetError):
    """An object-store operation failed (bad key, missing bucket, I/O error)."""


class ObjectNotFoundError(StorageError, KeyError):
    """``get`` of a key that does not exist. Also a ``KeyError`` for ``dict``-like use."""
