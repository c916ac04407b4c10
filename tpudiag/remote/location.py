"""Where a run's objects go: a ``gs://``, ``s3://`` or ``file://`` URL opened through fsspec.

Credentials come from the environment only (ADC / workload identity for gcsfs, the usual ``AWS_*`` variables or
instance roles for s3fs; ``STORAGE_EMULATOR_HOST`` and ``AWS_ENDPOINT_URL`` point the clients at a test server).
A URL that carries credentials (``s3://key:secret@bucket``, ``?token=...``) is refused without being echoed, and
every message tpudiag writes about a remote passes through ``redact`` first.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tpudiag.errors import UsageError

if TYPE_CHECKING:
    import fsspec

SCHEMES = {"gs": "gcs", "gcs": "gcs", "s3": "s3", "file": "file"}
EXTRAS = {"gcs": "gcsfs (pip install 'tpudiag[gcs]')", "s3": "s3fs (pip install 'tpudiag[s3]')"}
# Variables whose values are secrets: never written to a run, a log or a message.
SECRET_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
    "CLOUDSDK_AUTH_ACCESS_TOKEN",
    "GCS_OAUTH_TOKEN",
)
_URL_SECRETS = re.compile(r"(?i)((?:x-amz-|x-goog-)?(?:signature|credential|security-token|token|key)=)[^&\s]+")


def redact(text: str) -> str:
    """``text`` with every secret value of the environment and any signed-URL parameter blanked out."""
    for name in SECRET_VARS:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return _URL_SECRETS.sub(r"\1***", text)


@dataclass(frozen=True)
class Remote:
    """A parsed ``--remote`` URL: the fsspec protocol and the object prefix (``bucket/prefix``, no trailing /)."""

    url: str
    protocol: str  # "gcs" | "s3" | "file"
    prefix: str

    def path(self, *parts: str) -> str:
        """The fsspec path of an object under the prefix (no scheme)."""
        return "/".join([self.prefix, *parts]) if self.prefix else "/".join(parts)

    def uri(self, *parts: str) -> str:
        """The same object as a URL DuckDB opens through the registered filesystem."""
        scheme = {"gcs": "gs", "s3": "s3", "file": "file"}[self.protocol]
        return f"{scheme}://{self.path(*parts)}"

    def filesystem(self) -> fsspec.AbstractFileSystem:
        return open_filesystem(self.protocol)


def parse(url: str) -> Remote:
    parts = urlsplit(url.strip())
    protocol = SCHEMES.get(parts.scheme.lower())
    if protocol is None:
        raise UsageError("--remote needs a gs://, s3:// or file:// URL")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise UsageError("--remote: credentials come from the environment, never from the URL (user, query)")
    if protocol == "file":
        path = os.path.abspath(os.path.expanduser((parts.netloc or "") + parts.path))
        return Remote(f"file://{path}", protocol, path.rstrip("/") or "/")
    if not parts.netloc:
        raise UsageError(f"--remote {parts.scheme}:// needs a bucket name")
    prefix = (parts.netloc + "/" + parts.path.strip("/")).rstrip("/")
    return Remote(f"{parts.scheme.lower()}://{prefix}", protocol, prefix)


def open_filesystem(protocol: str) -> fsspec.AbstractFileSystem:
    """A fresh filesystem object (not fsspec's cached instance: the uploader retries against new connections)."""
    import fsspec

    try:
        if protocol == "gcs":
            # gcsfs >= 2026.10 first probes the bucket type over gRPC; against an emulator that hangs for 60 s.
            if os.environ.get("STORAGE_EMULATOR_HOST"):  # an emulator takes no credentials
                os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
                return fsspec.filesystem("gcs", skip_instance_cache=True, token="anon")
            return fsspec.filesystem("gcs", skip_instance_cache=True)
        if protocol == "s3":
            return fsspec.filesystem("s3", skip_instance_cache=True)
        return fsspec.filesystem("file", skip_instance_cache=True, auto_mkdir=True)
    except ImportError:
        raise UsageError(f"--remote {protocol}: needs {EXTRAS.get(protocol, protocol)}") from None
