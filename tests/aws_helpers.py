"""The ``aws`` backend against moto: a shared moto server (every AWS API over HTTP, bound to
127.0.0.1, free port), an IAM role Lambda accepts, a bucket, and a backend factory.

The server is reference-counted: :func:`moto_aws_backend` starts it for the first backend
and the last backend's ``teardown`` stops it, so a test module that creates backends gets
one server for its lifetime and leaves nothing running. Credentials are fake and passed
explicitly (a ``boto3.Session``), never read from the environment or ``~/.aws``.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from moefleet.platform import PlatformSpec

REGION = "us-east-1"
ROLE = "moefleet-lambda"
_lock = threading.Lock()
_server: Any = None
_endpoint = ""
_users = 0


def acquire_moto() -> str:
    """The shared server's URL (started on first use)."""
    global _server, _endpoint, _users
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    with _lock:
        if _server is None:
            server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0,
                                                    verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            _server, _endpoint = server, f"http://{host}:{port}"
        _users += 1
        return _endpoint


def release_moto() -> None:
    """Drop one user; the last one stops the server."""
    global _server, _users
    with _lock:
        _users -= 1
        if _users == 0 and _server is not None:
            _server.stop()
            _server = None


def fake_session() -> Any:
    import boto3

    return boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                         region_name=REGION)


def prepare(endpoint: str, bucket: str) -> str:
    """Create (if absent) ``bucket`` and an execution role; returns the role's ARN."""
    session = fake_session()
    s3 = session.client("s3", endpoint_url=endpoint)
    if bucket not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=bucket)
    iam = session.client("iam", endpoint_url=endpoint)
    try:
        return str(iam.get_role(RoleName=ROLE)["Role"]["Arn"])
    except iam.exceptions.NoSuchEntityException:
        trust = ('{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":'
                 '{"Service":"lambda.amazonaws.com"},"Action":"sts:AssumeRole"}]}')
        return str(iam.create_role(RoleName=ROLE, AssumeRolePolicyDocument=trust)["Role"]["Arn"])


def moto_aws_backend(platform: PlatformSpec, *, bucket: str = "moefleet-tests",
                     store: str | None = None, **options: Any) -> Any:
    """An in-process-invoker ``AwsBackend`` on the shared moto server; its store is a fresh
    prefix of ``bucket`` unless ``store`` is given. Teardown releases the server."""
    from moefleet.runtime.aws_backend import AwsBackend

    class MotoAwsBackend(AwsBackend):
        _released = False

        def teardown(self) -> None:
            try:
                super().teardown()
            finally:
                if not self._released:
                    self._released = True
                    release_moto()

    endpoint = acquire_moto()
    try:
        role = prepare(endpoint, bucket)
        store = store or f"s3://{bucket}/{uuid.uuid4().hex[:8]}?endpoint={endpoint}"
        options.setdefault("invoker", "in-process")
        return MotoAwsBackend(platform, store=store, region=REGION, endpoint_url=endpoint,
                              role_arn=role, session=fake_session(), **options)
    except BaseException:
        release_moto()
        raise
