"""S3ObjectStore specifics against moto's HTTP server on 127.0.0.1 (tests/conftest.py)."""

from __future__ import annotations

import pytest

from moefleet.platform import S3ObjectStore, StorageError, open_store

pytestmark = pytest.mark.integration


@pytest.fixture
def endpoint(moto_endpoint: str, aws_credentials: None) -> str:
    return moto_endpoint


def test_open_store_s3_url_with_endpoint_and_create(endpoint: str) -> None:
    store = open_store(f"s3://url-bucket/some/prefix?endpoint={endpoint}&create=1")
    assert isinstance(store, S3ObjectStore)
    assert (store.bucket, store.prefix, store.endpoint_url) == (
        "url-bucket",
        "some/prefix",
        endpoint,
    )
    store.put("k", b"v")
    # The object really sits under the prefix in the bucket (seen from a prefix-less store).
    root = S3ObjectStore("url-bucket", endpoint_url=endpoint)
    assert root.list() == ["some/prefix/k"]
    assert root.get("some/prefix/k") == b"v"


def test_prefixes_isolate_stores_in_one_bucket(endpoint: str) -> None:
    a = S3ObjectStore("shared", prefix="a", endpoint_url=endpoint, create_bucket=True)
    b = S3ObjectStore("shared", prefix="b", endpoint_url=endpoint, create_bucket=True)
    a.put("x", b"from a")
    assert b.list() == [] and not b.exists("x")
    assert a.list() == ["x"]


def test_missing_bucket_is_an_error_naming_it(endpoint: str) -> None:
    with pytest.raises(StorageError, match="no-such-bucket") as exc:
        S3ObjectStore("no-such-bucket", endpoint_url=endpoint)
    assert "create_bucket=True" in exc.value.hint


def test_other_region_bucket_creation(endpoint: str) -> None:
    store = S3ObjectStore(
        "eu-bucket", endpoint_url=endpoint, region="eu-west-1", create_bucket=True
    )
    store.put("k", b"v")
    assert store.get("k") == b"v"


def test_list_follows_pagination(endpoint: str) -> None:
    # Small pages stand in for S3's 1000-key pages, so the test stays fast.
    store = S3ObjectStore("many", endpoint_url=endpoint, create_bucket=True, list_page_size=10)
    for i in range(25):
        store.put(f"k{i:02d}", b"")
    store.reset_stats()
    keys = store.list("k")
    assert keys == [f"k{i:02d}" for i in range(25)]
    assert store.stats().lists == 3  # 25 keys in pages of 10: three LIST requests
