"""An S3-compatible store a test starts: moto's server (`moto[server]`, in the dev extra) on a free loopback port.

    s3 = S3Server.start()                 # waits until it answers; a bucket made
    s3.url("prefix")                      # s3://<bucket>/prefix
    s3.env                                # AWS_ENDPOINT_URL, credentials and region for a server or client process
    s3.objects()                          # {key: bytes} of every object in the bucket
    s3.stop(); s3.restart()               # moto keeps its data in memory: a restarted store is empty

The `s3_server` fixture (import it into a test module) gives one per module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from servers import free_port

MOTO = Path(sys.executable).with_name("moto_server")


@dataclass
class S3Server:
    port: int
    bucket: str
    process: subprocess.Popen | None = None
    log: Path = field(default_factory=lambda: Path(os.devnull))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach it (boto3/botocore read AWS_ENDPOINT_URL; s3fs goes through them)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    @classmethod
    def start(cls, log: Path | None = None) -> "S3Server":
        if not MOTO.exists() and shutil.which("moto_server") is None:
            pytest.fail("moto_server is missing: `pip install 'moto[server]'` (the dev extra has it; `make install`)")
        server = cls(free_port(), f"stepwise-{uuid.uuid4().hex[:8]}", log=log or Path(os.devnull))
        server.restart()
        return server

    def restart(self) -> None:
        """(Re)start moto on the same port and make the bucket (a restarted moto holds nothing)."""
        self.stop()
        out = open(self.log, "ab")
        self.process = subprocess.Popen([str(MOTO if MOTO.exists() else "moto_server"), "-H", "127.0.0.1", "-p",
                                         str(self.port)], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.endpoint, timeout=1)
                break
            except httpx.TransportError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on {self.endpoint}")
                time.sleep(0.05)
        self.client().create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def objects(self, prefix: str = "") -> dict[str, bytes]:
        client, out = self.client(), {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                out[item["Key"]] = client.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read()
        return out


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    server = S3Server.start(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()
