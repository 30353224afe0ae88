"""Platform layer: what a platform offers and charges, how a run is billed, where bytes live.

- :mod:`~moefleet.platform.specs` / :mod:`~moefleet.platform.catalog`: ``PlatformSpec`` and
  the shipped catalog (``load_platform("aws-lambda")``, ``list_platforms()``);
- :mod:`~moefleet.platform.billing`: ``InvocationRecord`` → ``Meter`` → ``Bill``, and
  ``bill_cluster`` for rented machines;
- :mod:`~moefleet.platform.storage`: ``ObjectStore`` (local directory, S3 via the ``aws``
  extra) and ``open_store(url)``.

Units: seconds, bytes, MB (1 GB = 1024 MB), USD.
"""

from moefleet.platform.billing import (
    Bill,
    ClusterBill,
    CostParts,
    InvocationRecord,
    Meter,
    bill_cluster,
    price_invocation,
)
from moefleet.platform.catalog import (
    DEFAULT_PLATFORM,
    catalog_dir,
    list_platforms,
    load_platform,
    load_platform_file,
    parse_platform,
)
from moefleet.platform.errors import (
    InvalidMemoryError,
    ObjectNotFoundError,
    PlatformConfigError,
    PlatformError,
    StorageError,
)
from moefleet.platform.s3 import S3ObjectStore
from moefleet.platform.specs import MB_PER_GB, PlatformSpec
from moefleet.platform.storage import (
    LocalObjectStore,
    ObjectStore,
    StoreStats,
    open_store,
    validate_key,
)

__all__ = [
    "DEFAULT_PLATFORM",
    "MB_PER_GB",
    "Bill",
    "ClusterBill",
    "CostParts",
    "InvalidMemoryError",
    "InvocationRecord",
    "LocalObjectStore",
    "Meter",
    "ObjectNotFoundError",
    "ObjectStore",
    "PlatformConfigError",
    "PlatformError",
    "PlatformSpec",
    "S3ObjectStore",
    "StorageError",
    "StoreStats",
    "bill_cluster",
    "catalog_dir",
    "list_platforms",
    "load_platform",
    "load_platform_file",
    "open_store",
    "parse_platform",
    "price_invocation",
    "validate_key",
]
