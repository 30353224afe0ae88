"""``S3ObjectStore``: the ``ObjectStore`` interface over an S3 bucket (boto3, optional).

boto3 is imported when a store is created, not when this module is imported, so
``moefleet.platform`` works without the ``aws`` extra. Any S3-compatible endpoint works
(MinIO, moto's server in tests) through ``endpoint_url``.
"""

from __future__ import annotations

import builtins
import os
import tempfile
from pathlib import Path
from typing import Any

from moefleet.errors import MissingExtraError
from moefleet.platform.errors import ObjectNotFoundError, StorageError
from moefleet.platform.storage import ObjectStore, validate_key

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise MissingExtraError("boto3", "aws") from None
    return boto3


class S3ObjectStore(ObjectStore):
    """Objects in ``bucket`` under an optional key ``prefix`` (keys passed to the methods
    are relative to it). ``create_bucket=True`` creates a missing bucket; otherwise a
    missing bucket is an error at construction, naming the bucket. ``client`` injects a
    ready boto3 S3 client; ``list_page_size`` is keys per LIST request (S3 allows 1000)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        create_bucket: bool = False,
        client: Any | None = None,
        list_page_size: int = 1000,
    ) -> None:
        super().__init__()
        if not 1 <= list_page_size <= 1000:
            raise StorageError(f"list_page_size must be 1..1000 (S3's limit), got {list_page_size}")
        self.list_page_size = list_page_size
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            validate_key(self.prefix)
        self.endpoint_url = endpoint_url
        self.region = region
        query = f"?endpoint={endpoint_url}" if endpoint_url else ""
        self.url = f"s3://{bucket}/{self.prefix}{query}"
        if client is None:
            boto3 = _boto3()
            client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region)
        self._client = client
        self._errors = self._botocore_errors()
        self._ensure_bucket(create_bucket)

    @staticmethod
    def _botocore_errors() -> tuple[type[Exception], ...]:
        try:
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError:  # a test double client without botocore installed
            return ()
        return (ClientError, BotoCoreError)

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _code(self, err: Exception) -> str:
        response = getattr(err, "response", None) or {}
        return str(response.get("Error", {}).get("Code", ""))

    def _fail(self, what: str, err: Exception) -> StorageError:
        hint = ""
        if type(err).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            hint = "configure AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile)"
        elif self._code(err) == "NoSuchBucket":
            hint = f"create bucket '{self.bucket}' or open the store with create_bucket=True"
        return StorageError(f"S3 {what} failed on {self.url}: {err}", hint)

    def _ensure_bucket(self, create: bool) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except self._errors as err:
            if self._code(err) not in _NOT_FOUND | {"NoSuchBucket"}:
                raise self._fail("head_bucket", err) from None
        if not create:
            raise StorageError(
                f"S3 bucket '{self.bucket}' does not exist",
                "create it, or pass create_bucket=True (URL option create=1)",
            )
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region != "us-east-1":  # us-east-1 rejects an explicit LocationConstraint
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            self._client.create_bucket(**kwargs)
        except self._errors as err:
            if self._code(err) not in ("BucketAlreadyOwnedByYou",):
                raise self._fail("create_bucket", err) from None

    def put(self, key: str, data: bytes) -> None:
        full = self._full(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=full, Body=bytes(data))
        except self._errors as err:
            raise self._fail(f"put {key!r}", err) from None
        self._count(puts=1, bytes_written=len(data))

    def get(self, key: str) -> bytes:
        full = self._full(key)
        self._count(gets=1)
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
            data = bytes(body.read())
        except self._errors as err:
            if self._code(err) in _NOT_FOUND:
                raise ObjectNotFoundError(f"no object {key!r} in {self.url}") from None
            raise self._fail(f"get {key!r}", err) from None
        self._count(bytes_read=len(data))
        return data

    def exists(self, key: str) -> bool:
        full = self._full(key)
        self._count(gets=1)  # HEAD is priced like GET
        try:
            self._client.head_object(Bucket=self.bucket, Key=full)
        except self._errors as err:
            if self._code(err) in _NOT_FOUND:
                return False
            raise self._fail(f"head {key!r}", err) from None
        return True

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._count(deletes=1)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=full)  # idempotent on S3
        except self._errors as err:
            raise self._fail(f"delete {key!r}", err) from None

    def list(self, prefix: str = "") -> builtins.list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        keys: builtins.list[str] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket,
                Prefix=base + prefix,
                PaginationConfig={"PageSize": self.list_page_size},
            )
            for page in pages:
                self._count(lists=1)  # one LIST request per page
                keys.extend(obj["Key"][len(base) :] for obj in page.get("Contents", []))
        except self._errors as err:
            raise self._fail(f"list {prefix!r}", err) from None
        return sorted(keys)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        full = self._full(key)
        size = Path(path).stat().st_size
        try:
            # upload_file may split into a multipart upload; we count it as one PUT.
            self._client.upload_file(os.fspath(path), self.bucket, full)
        except self._errors as err:
            raise self._fail(f"upload {key!r}", err) from None
        self._count(puts=1, bytes_written=size)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Stream to a temp file beside ``path``, then rename: never a half-written file."""
        full = self._full(key)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".obj-", suffix=".tmp", dir=target.parent)
        os.close(fd)
        self._count(gets=1)
        try:
            self._client.download_file(self.bucket, full, tmp)
            os.replace(tmp, target)
        except self._errors as err:
            if self._code(err) in _NOT_FOUND:
                raise ObjectNotFoundError(f"no object {key!r} in {self.url}") from None
            raise self._fail(f"download {key!r}", err) from None
        finally:
            Path(tmp).unlink(missing_ok=True)
        self._count(bytes_read=target.stat().st_size)

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.url!r})"
