"""The ``aws`` backend's calls to the Lambda and S3 APIs (boto3), with bounded retries.

Every botocore client here makes exactly one attempt per call (botocore's own retries are
off), so retries are counted and bounded in one place: a control-plane call that AWS
answers with a throttling/service/conflict code is retried ``max_retries`` times with
exponential backoff; ``invoke`` raises :class:`Retry` for the caller's retry loop instead.
"""

from __future__ import annotations

import time
from typing import Any

from moefleet.errors import MoefleetError
from moefleet.runtime.aws_package import LambdaZip
from moefleet.runtime.errors import FunctionError, PayloadTooLargeError, UnknownFunctionError

# Error codes after which the same request may succeed (Lambda's 429/5xx and conflicts).
RETRY_CODES = {"TooManyRequestsException", "ThrottlingException", "ServiceException",
               "EC2ThrottledException", "ResourceConflictException", "ResourceNotReadyException",
               "SubnetIPAddressLimitReachedException", "ENILimitReachedException"}
CODE_PREFIX = "moefleet-code"  # key prefix of uploaded zips in the code bucket


class Retry(Exception):
    """One invoke attempt failed transiently: the process died (``crashed``), or Lambda
    throttled or failed to run it."""

    def __init__(self, reason: str, crashed: bool) -> None:
        super().__init__(reason)
        self.crashed = crashed


def error_code(err: Exception) -> str:
    """The AWS error code of a botocore ``ClientError`` ('' for anything else)."""
    return str((getattr(err, "response", None) or {}).get("Error", {}).get("Code", ""))


class LambdaApi:
    """boto3 Lambda and S3 clients of one ``session`` (``endpoint_url``: moto, LocalStack).
    ``read_timeout_s`` must exceed the longest function timeout (invoke is synchronous)."""

    def __init__(self, session: Any, region: str, endpoint_url: str | None, *,
                 max_retries: int, retry_backoff_s: float, read_timeout_s: float) -> None:
        from botocore.config import Config

        config = Config(retries={"total_max_attempts": 1, "mode": "standard"},
                        read_timeout=read_timeout_s, connect_timeout=10)
        self.lambda_ = session.client("lambda", region_name=region, endpoint_url=endpoint_url,
                                      config=config)
        self.s3 = session.client("s3", region_name=region, endpoint_url=endpoint_url,
                                 config=Config(retries={"total_max_attempts": 1}))
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s

    def call(self, what: str, fn: str, method: Any, **kwargs: Any) -> Any:
        """``method(**kwargs)``, retried while AWS says 'try again'; a ``ClientError`` with
        another code is re-raised for the caller to interpret."""
        from botocore.exceptions import BotoCoreError, ClientError

        for attempt in range(self.max_retries + 1):
            try:
                return method(**kwargs)
            except ClientError as err:
                if error_code(err) not in RETRY_CODES or attempt == self.max_retries:
                    raise
            except BotoCoreError as err:  # no answer at all (connection, timeout)
                if attempt == self.max_retries:
                    raise FunctionError(f"{fn}: {what} failed: {err}",
                                        "check the endpoint, region and credentials") from err
            time.sleep(self.retry_backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def wait_ready(self, fn: str, timeout_s: float = 300.0) -> dict[str, Any]:
        """Poll until the function is Active and its last update Successful (Lambda rejects
        an update while another is in progress); returns its configuration."""
        deadline = time.monotonic() + timeout_s
        while True:
            c: dict[str, Any] = self.call("GetFunctionConfiguration", fn,
                                          self.lambda_.get_function_configuration,
                                          FunctionName=fn)
            state, update = c.get("State", "Active"), c.get("LastUpdateStatus", "Successful")
            if "Failed" in (state, update):
                raise FunctionError(f"{fn}: Lambda reports state {state}, last update {update}: "
                                    f"{c.get('StateReason') or c.get('LastUpdateStatusReason')}",
                                    "check the role, the code (zip or image) and the memory")
            if state == "Active" and update == "Successful":
                return c
            if time.monotonic() > deadline:
                raise FunctionError(f"{fn}: still {state}/{update} after {timeout_s:g} s",
                                    "check the function in the Lambda console")
            time.sleep(0.5)

    def upload_zip(self, bucket: str, zipped: LambdaZip) -> dict[str, str]:
        """Put the zip in ``bucket`` unless that code hash is there already; returns the
        ``Code`` arguments of create/update calls."""
        from botocore.exceptions import ClientError

        key = f"{CODE_PREFIX}/lambda-{zipped.code_hash}.zip"
        try:
            self.s3.head_object(Bucket=bucket, Key=key)
        except ClientError as err:
            if error_code(err) not in ("404", "NoSuchKey", "NotFound"):
                raise MoefleetError(f"cannot use code bucket {bucket!r}: {err}",
                                    "create the bucket, or pass code_bucket=...") from err
            self.call("PutObject", key, self.s3.put_object, Bucket=bucket, Key=key,
                      Body=zipped.path.read_bytes())
        return {"S3Bucket": bucket, "S3Key": key}

    def put_function(self, fn: str, code: dict[str, str], settings: dict[str, Any],
                     tags: dict[str, str]) -> bool:
        """Create ``fn``, or update its code then its configuration; True when created."""
        from botocore.exceptions import ClientError

        try:
            try:
                self.call("GetFunction", fn, self.lambda_.get_function, FunctionName=fn)
            except ClientError as err:
                if error_code(err) != "ResourceNotFoundException":
                    raise
                self.call("CreateFunction", fn, self.lambda_.create_function, FunctionName=fn,
                          Code=code, PackageType="Image" if "ImageUri" in code else "Zip",
                          Tags=tags, **settings)
                self.wait_ready(fn)
                return True
            self.call("UpdateFunctionCode", fn, self.lambda_.update_function_code,
                      FunctionName=fn, **code)
            self.wait_ready(fn)
            self.call("UpdateFunctionConfiguration", fn,
                      self.lambda_.update_function_configuration, FunctionName=fn, **settings)
            self.wait_ready(fn)
            return False
        except ClientError as err:
            raise FunctionError(f"{fn}: deploying failed: {err}",
                                "check the role (lambda.amazonaws.com must be able to assume "
                                "it), the code bucket and the account's limits") from err

    def reserve(self, fn: str, executions: int) -> str | None:
        """Set reserved concurrency; the error text when the account does not allow it."""
        from botocore.exceptions import ClientError

        try:
            self.call("PutFunctionConcurrency", fn, self.lambda_.put_function_concurrency,
                      FunctionName=fn, ReservedConcurrentExecutions=executions)
        except ClientError as err:  # e.g. the account must keep 100 executions unreserved
            return str(err)
        return None

    def delete(self, fn: str) -> str | None:
        """Delete ``fn`` (absent is fine); the error text when it could not be deleted."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.call("DeleteFunction", fn, self.lambda_.delete_function, FunctionName=fn)
        except ClientError as err:
            return None if error_code(err) == "ResourceNotFoundException" else str(err)
        except (BotoCoreError, FunctionError) as err:
            return str(err)
        return None

    def invoke(self, name: str, fn: str, event: bytes) -> dict[str, Any]:
        """One synchronous invoke with the log tail; ``Payload`` read into bytes. Raises
        :class:`Retry` for throttling and transport errors."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            response: dict[str, Any] = self.lambda_.invoke(
                FunctionName=fn, InvocationType="RequestResponse", LogType="Tail",
                Payload=event)
        except ClientError as err:
            code = error_code(err)
            if code == "ResourceNotFoundException":
                raise UnknownFunctionError(f"{name}: Lambda function {fn} does not exist",
                                           "deploy it again") from err
            if code == "RequestTooLargeException":
                raise PayloadTooLargeError(f"{name}: request payload rejected by Lambda: {err}",
                                           "send fewer tokens, or use the object store") from err
            if code in RETRY_CODES:
                raise Retry(f"{code}: {err}", crashed=False) from err
            raise FunctionError(f"{name}: invoking {fn} failed: {err}", "see above") from err
        except BotoCoreError as err:  # connection trouble: the caller may retry
            raise Retry(f"{type(err).__name__}: {err}", crashed=False) from err
        response["Payload"] = response["Payload"].read()
        return response
