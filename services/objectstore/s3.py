"""`S3ObjectStore`: code archives and results in an S3-compatible store, and the
job-scoped credentials learners use to reach them.

The platform's own credentials come from the standard AWS sources (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, ...); the endpoint from `--object-store-endpoint`
(`RHIZOME_OBJECT_STORE_ENDPOINT`).

Why session credentials (STS `AssumeRole`) and not presigned URLs: a presigned URL
names one object and one method, which fits the code archive but not checkpoints — the
checkpoint SDK lists, writes, reads and deletes objects whose names it chooses as it
goes. So each job gets an IAM role of its own, `rhizome-job-<job>`, whose inline policy
allows exactly:

- `s3:GetObject` on its code archive, `models/<job>.zip`;
- `s3:GetObject`, `s3:PutObject`, `s3:DeleteObject` under `checkpoints/<job>/` and
  `results/<job>/`;
- `s3:ListBucket` on the bucket, for those two prefixes (the `s3:prefix` condition);

and its learners get `AssumeRole` session credentials of that role, which expire after
the grant's TTL (`DurationSeconds`). The role trusts only the platform's own identity.
`revoke` (when the job's deploy is rolled back or the job ends) replaces the role's
policy by a deny-all one, so the credentials stop working at once, before they expire.

Tested against moto's server with IAM enforcement on: a job's credentials read its own
objects and are denied another job's; after `revoke` they are denied everything. moto
enforces neither a session's expiry (the `Expiration` STS returns, which AWS enforces) nor
the `s3:prefix` condition on listing (so there a job could list, not read, another job's
key names).
"""

from __future__ import annotations

import json
import time
from typing import Any

import boto3
import botocore.exceptions
from botocore.config import Config

from contract.learner_spec import StorageAccess
from services.objectstore.api import (
    GrantError,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    check_key,
    checkpoint_prefix,
    model_key,
    result_prefix,
)

_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
_POLICY_NAME = "rhizome-job-objects"
# STS's own bounds on DurationSeconds (AWS: 15 min to the role's maximum, at most 12 h).
_MIN_TTL_S, _MAX_TTL_S = 900, 43200


def _code(err: Exception) -> str:
    if isinstance(err, botocore.exceptions.ClientError):
        return str(err.response.get("Error", {}).get("Code", ""))
    return ""


def role_name(job_id: str) -> str:
    return f"rhizome-job-{job_id}"[:64]  # IAM role names are at most 64 characters


class S3ObjectStore(ObjectStore):
    remote = True

    def __init__(
        self, bucket: str, prefix: str = "", *, endpoint_url: str, region: str = "us-east-1"
    ) -> None:
        if not endpoint_url:
            raise ObjectStoreError(
                f"s3://{bucket}: no endpoint; pass --object-store-endpoint (or set "
                "RHIZOME_OBJECT_STORE_ENDPOINT) to the S3-compatible server's URL, e.g. "
                "http://127.0.0.1:9000 (https://s3.<region>.amazonaws.com for AWS)"
            )
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.region = region
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        config = Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3})
        session = boto3.session.Session(region_name=region)
        self.s3 = session.client("s3", endpoint_url=endpoint_url, config=config)
        self.iam = session.client("iam", endpoint_url=endpoint_url, config=config)
        self.sts = session.client("sts", endpoint_url=endpoint_url, config=config)
        self._caller: str = ""

    @classmethod
    def from_url(cls, url: str, *, endpoint_url: str = "", **_: Any) -> S3ObjectStore:
        bucket, _sep, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise ObjectStoreError(f"{url}: no bucket; write s3://BUCKET or s3://BUCKET/PREFIX")
        return cls(bucket, prefix, endpoint_url=endpoint_url)

    def _where(self) -> str:
        return f"{self.url} at {self.endpoint_url}"

    def _error(self, what: str, err: Exception) -> ObjectStoreError:
        code = _code(err)
        if isinstance(err, botocore.exceptions.EndpointConnectionError):
            return ObjectStoreError(
                f"{what} {self._where()}: cannot reach the endpoint; start the server or fix "
                "--object-store-endpoint"
            )
        if isinstance(err, botocore.exceptions.NoCredentialsError):
            return ObjectStoreError(
                f"{what} {self._where()}: the platform has no credentials; set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for rhizomed"
            )
        if code in ("NoSuchBucket",):
            return ObjectStoreError(
                f"{what} {self._where()}: bucket {self.bucket!r} does not exist; create it or "
                "fix --object-store"
            )
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return ObjectStoreError(
                f"{what} {self._where()}: access denied ({code}); the platform's credentials "
                "need s3, iam:*Role* and sts:AssumeRole permissions"
            )
        return ObjectStoreError(f"{what} {self._where()}: {err}")

    def key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- objects ---------------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        # One PUT is atomic in S3: readers see the old object, or none, or the whole new one.
        try:
            self.s3.put_object(Bucket=self.bucket, Key=self.key(key), Body=data)
        except _ERRORS as err:
            raise self._error(f"cannot store {key} in", err) from err

    def get(self, key: str) -> bytes:
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self.key(key))["Body"]
            return bytes(body.read())
        except _ERRORS as err:
            if _code(err) in ("NoSuchKey", "404"):
                raise ObjectNotFound(f"no object {key} in {self._where()}") from None
            raise self._error(f"cannot read {key} from", err) from err

    def list_keys(self, prefix: str) -> list[str]:
        start = self.key(prefix).rstrip("/") + "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=start
            ):
                keys += [str(item["Key"])[strip:] for item in page.get("Contents", [])]
        except _ERRORS as err:
            raise self._error(f"cannot list {prefix} in", err) from err
        return sorted(keys)

    def exists(self, key: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=self.key(key))
            return True
        except _ERRORS as err:
            if _code(err) in ("NoSuchKey", "404", "NotFound"):
                return False
            raise self._error(f"cannot look up {key} in", err) from err

    def delete(self, key: str) -> None:
        try:
            self.s3.delete_object(Bucket=self.bucket, Key=self.key(key))
        except _ERRORS as err:
            raise self._error(f"cannot delete {key} from", err) from err

    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist (the daemon's start)."""
        try:
            self.s3.head_bucket(Bucket=self.bucket)
        except _ERRORS as err:
            if _code(err) not in ("404", "NoSuchBucket", "NotFound"):
                raise self._error("cannot open", err) from err
            try:
                self.s3.create_bucket(Bucket=self.bucket)
            except _ERRORS as err2:
                raise self._error("cannot create the bucket of", err2) from err2

    # -- job-scoped credentials -------------------------------------------------------------
    def policy(self, job_id: str, with_model: bool) -> dict[str, Any]:
        """What a job's learners may do: their code, their checkpoints and results."""
        bucket_arn = f"arn:aws:s3:::{self.bucket}"
        folders = [self.key(checkpoint_prefix(job_id)), self.key(result_prefix(job_id))]
        statements: list[dict[str, Any]] = [
            {
                "Sid": "JobFolders",
                "Effect": "Allow",
                "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                "Resource": [f"{bucket_arn}/{f}/*" for f in folders],
            },
            {
                "Sid": "ListJobFolders",
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [bucket_arn],
                "Condition": {"StringLike": {"s3:prefix": [f"{f}/*" for f in folders]}},
            },
        ]
        if with_model:
            statements.append(
                {
                    "Sid": "JobCode",
                    "Effect": "Allow",
                    "Action": ["s3:GetObject"],
                    "Resource": [f"{bucket_arn}/{self.key(model_key(job_id))}"],
                }
            )
        return {"Version": "2012-10-17", "Statement": statements}

    def caller_arn(self) -> str:
        if not self._caller:
            self._caller = str(self.sts.get_caller_identity()["Arn"])
        return self._caller

    def grant(self, job_id: str, *, with_model: bool, ttl_s: float) -> StorageAccess:
        ttl = int(min(max(ttl_s, _MIN_TTL_S), _MAX_TTL_S))
        name = role_name(job_id)
        try:
            trust = {
                "Version": "2012-10-17",
                "Statement": [
                    {
                        "Effect": "Allow",
                        "Principal": {"AWS": self.caller_arn()},
                        "Action": "sts:AssumeRole",
                    }
                ],
            }
            try:
                role = self.iam.create_role(
                    RoleName=name,
                    AssumeRolePolicyDocument=json.dumps(trust),
                    MaxSessionDuration=_MAX_TTL_S,
                    Description=f"rhizome job {job_id}: its code, checkpoints and results",
                )["Role"]
            except botocore.exceptions.ClientError as err:
                if _code(err) != "EntityAlreadyExists":
                    raise
                role = self.iam.get_role(RoleName=name)["Role"]
            self.iam.put_role_policy(
                RoleName=name,
                PolicyName=_POLICY_NAME,
                PolicyDocument=json.dumps(self.policy(job_id, with_model)),
            )
            creds = self.sts.assume_role(
                RoleArn=role["Arn"], RoleSessionName=f"rhizome-{job_id}"[:64], DurationSeconds=ttl
            )["Credentials"]
        except _ERRORS as err:
            raise GrantError(
                f"job {job_id}: cannot issue storage credentials on {self._where()}: "
                f"{self._error('', err)}"
            ) from err
        expiration = creds["Expiration"]
        expires_at = expiration.timestamp() if hasattr(expiration, "timestamp") else time.time()
        return StorageAccess(
            kind="s3",
            endpoint_url=self.endpoint_url,
            bucket=self.bucket,
            model_key=self.key(model_key(job_id)) if with_model else "",
            checkpoint_prefix=self.key("checkpoints"),
            result_prefix=self.key(result_prefix(job_id)),
            access_key_id=str(creds["AccessKeyId"]),
            secret_access_key=str(creds["SecretAccessKey"]),
            session_token=str(creds["SessionToken"]),
            expires_at=expires_at,
            region=self.region,
        )

    def revoke(self, job_id: str) -> None:
        """Replace the job role's policy by one that denies everything: every session
        issued for the job is refused from the next request on (AWS's own way to revoke
        a role's active sessions). The role stays, denying, so a later grant for the same
        job (a deploy retry) simply puts the job's policy back."""
        deny = {
            "Version": "2012-10-17",
            "Statement": [{"Sid": "Revoked", "Effect": "Deny", "Action": "*", "Resource": "*"}],
        }
        try:
            self.iam.put_role_policy(
                RoleName=role_name(job_id), PolicyName=_POLICY_NAME, PolicyDocument=json.dumps(deny)
            )
        except _ERRORS as err:
            if _code(err) == "NoSuchEntity":
                return  # never granted: nothing to revoke
            raise GrantError(
                f"job {job_id}: cannot revoke its storage credentials on {self._where()}: "
                f"{self._error('', err)}"
            ) from err


def open_s3(url: str, *, endpoint_url: str = "", **_: Any) -> S3ObjectStore:
    """The registry's factory for `s3://` URLs."""
    return S3ObjectStore.from_url(url, endpoint_url=endpoint_url)
