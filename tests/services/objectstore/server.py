"""An S3-compatible server for tests: moto's standalone server on 127.0.0.1, started on a
free port and stopped by its pid, with IAM enforcement switched on.

moto answers every request while its "initial no-auth action count" lasts (unbounded by
default). `MotoS3.start()` first creates the platform's IAM user (an access key with an
allow-everything policy) and a bucket, then sets that count to 0 through moto's
`/moto-api/reset-auth`: from then on a request signed by a key moto does not know, or by
a role whose policy does not allow it, is refused — which is what the job-scoping tests
need. Used by tests/services/objectstore and tests/docker.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import boto3
import pytest

from contract.procs import free_port

REGION = "us-east-1"


def moto_server_binary() -> str:
    local = Path(sys.executable).parent / "moto_server"
    found = str(local) if local.exists() else shutil.which("moto_server")
    if not found:
        pytest.fail(
            "moto_server is not installed: run `make install` (requirements.txt pins moto[server])"
        )
    return found


class MotoS3:
    def __init__(self, bucket: str = "rhizome") -> None:
        self.bucket = bucket
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.platform_env: dict[str, str] = {}

    def start(self) -> MotoS3:
        env = {**os.environ, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        self.proc = subprocess.Popen(
            [moto_server_binary(), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, "moto_server exited at start"
            try:
                urllib.request.urlopen(self.url, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # it answered
            except OSError:
                assert time.monotonic() < deadline, "moto_server never answered"
                time.sleep(0.1)
        bootstrap = self.client("iam", "bootstrap", "bootstrap")
        bootstrap.create_user(UserName="rhizome-platform")
        bootstrap.put_user_policy(
            UserName="rhizome-platform",
            PolicyName="all",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
                }
            ),
        )
        key = bootstrap.create_access_key(UserName="rhizome-platform")["AccessKey"]
        self.platform_env = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_DEFAULT_REGION": REGION,
            "NO_PROXY": "127.0.0.1",
            "no_proxy": "127.0.0.1",
        }
        self.client("s3", key["AccessKeyId"], key["SecretAccessKey"]).create_bucket(
            Bucket=self.bucket
        )
        request = urllib.request.Request(
            f"{self.url}/moto-api/reset-auth",
            data=b"0",
            headers={"Content-Type": "text/plain"},  # a form body would be parsed away
        )
        urllib.request.urlopen(request, timeout=10).close()
        return self

    def client(self, service: str, key_id: str, secret: str, token: str | None = None) -> Any:
        return boto3.client(
            service,
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            aws_session_token=token,
        )

    def platform_client(self, service: str = "s3") -> Any:
        env = self.platform_env
        return self.client(service, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
