"""The end-to-end tests' shared fixtures: an S3 server (moto) on this machine's loopback."""
from __future__ import annotations

import pytest

BUCKET = "runs"


@pytest.fixture(scope="module")
def s3():
    """An S3 server (moto; the test is skipped without it) on this machine's loopback, with one bucket;
    yields the storage URI's root."""
    import logging

    moto_server = pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (the test extra)")
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    yield f"s3://{BUCKET}/{{prefix}}?endpoint_override={endpoint}&scheme=http"
    server.stop()
