"""Real object-storage servers on loopback for the ``--remote`` tests: moto's S3 server (in this process, so it can
be stopped and started again with its buckets kept) and ``gcp-storage-emulator`` (a subprocess)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Planted in the environment of every process of these tests; no output or file may ever contain it.
SECRET = "tpudiagPLANTEDsecret9f3e1c"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@dataclass
class S3Server:
    port: int
    server: object

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "tpudiagtestkey",
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def stop(self) -> None:
        self.server.stop()  # type: ignore[attr-defined]

    def start(self) -> None:
        self.server.start()  # type: ignore[attr-defined]
        _wait_port(self.port)


@contextlib.contextmanager
def s3_server(bucket: str = "pod") -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    _wait_port(port)
    s3 = S3Server(port, server)
    saved = {k: os.environ.get(k) for k in s3.env}
    os.environ.update(s3.env)
    try:
        import s3fs

        with contextlib.suppress(FileExistsError):  # moto keeps its buckets for the life of this process
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        yield s3
    finally:
        with contextlib.suppress(Exception):
            server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class GcsServer:
    port: int

    @property
    def env(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.port}",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # else gcsfs 2026.10 hangs 60 s on a gRPC probe
            "GOOGLE_OAUTH_ACCESS_TOKEN": SECRET,
        }


@contextlib.contextmanager
def gcs_server(tmp: Path, bucket: str = "pod") -> Iterator[GcsServer]:
    port = free_port()
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    proc = subprocess.Popen(
        [str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--default-bucket", bucket],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    gcs = GcsServer(port)
    saved = {k: os.environ.get(k) for k in gcs.env}
    try:
        _wait_port(port)
        os.environ.update(gcs.env)
        yield gcs
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
