"""``tpudiag dashboard``: serve the Streamlit app on a store, headless, on 127.0.0.1 unless asked otherwise.

The app runs in a child ``streamlit run`` process with ``TPUDIAG_DB`` set to the store; this command waits
until the server answers its health check, prints the URL, and stops the child when interrupted or terminated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

from tpudiag.errors import StoreError, StoreLockedError, UsageError
from tpudiag.store import resolve_db_path
from tpudiag.store_access import open_store

DEFAULT_PORT = 8501
STARTUP_TIMEOUT_S = 90.0


def app_script() -> Path:
    import tpudiag.app

    return Path(tpudiag.app.__file__).resolve().parent / "main.py"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port(host: str, port: int) -> None:
    """Fail with one line when the address cannot be served (port taken, unknown host)."""
    if not 0 < port < 65536:
        raise UsageError(f"--port must be between 1 and 65535 (or 0 for any free port), not {port}")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # As the server will: a port left in TIME_WAIT by a previous dashboard is free, a listener is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as err:
        if err.errno in (98, 48):  # EADDRINUSE on Linux, macOS
            raise UsageError(f"port {port} on {host} is already in use (pick another with --port)") from None
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def check_store(path: Path) -> None:
    """A missing store is fine (the app teaches how to capture); anything else must be a readable store."""
    store = open_store(path, lock_timeout_s=5.0)
    if not store.exists():
        return
    # A capture is writing: fine, the app retries on its own.
    with contextlib.suppress(StoreLockedError), store.reader():
        pass


def streamlit_command(script: Path, host: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "streamlit", "run", str(script),
        "--server.headless", "true",
        "--server.address", host,
        "--server.port", str(port),
        "--server.fileWatcherType", "none",
        "--server.runOnSave", "false",
        "--browser.gatherUsageStats", "false",
        "--global.developmentMode", "false",
        "--client.toolbarMode", "viewer",
        "--theme.base", "light",
        "--logger.level", "warning",
    ]  # fmt: skip


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StoreError(f"the dashboard server exited during startup (exit code {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise UsageError(f"the dashboard server did not answer within {timeout_s:g} s")


def cmd_dashboard(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise UsageError(f"unexpected arguments: {' '.join(rest)}")
    if args.run and not args.remote:
        raise UsageError("--run picks a run of --remote URL (a local store's runs are picked in the dashboard)")
    if args.remote:
        with tempfile.TemporaryDirectory(prefix="tpudiag-remote-view-") as tmp:
            return _serve(args, remote_view(args.remote, args.run, Path(tmp)))
    path = resolve_db_path(args.db).absolute()
    if path.is_dir():
        raise StoreError(f"store path {path} is a directory, not a DuckDB file")
    check_store(path)
    return _serve(args, path)


def remote_view(url: str, run_id: str | None, folder: Path) -> Path:
    """A view store of the bucket's run under ``folder`` (deleted when the dashboard stops)."""
    from tpudiag.remote.location import parse, redact
    from tpudiag.remote.view import view_store

    remote = parse(url)
    sys.stderr.write(f"tpudiag: reading {redact(remote.url)} ...\n")
    store, run = view_store(folder, remote, run_id)
    sys.stderr.write(f"tpudiag: run {run.id} ({run.status}) read from the bucket\n")
    return store.path


def _serve(args: argparse.Namespace, path: Path) -> int:
    host = args.host
    port = free_port(host) if args.port == 0 else args.port
    check_port(host, port)
    url = f"http://{host}:{port}"
    env = {**os.environ, "TPUDIAG_DB": str(path), "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    sys.stderr.write(f"tpudiag: starting the dashboard on {path} ...\n")
    proc = subprocess.Popen(streamlit_command(app_script(), host, port), env=env, stdout=subprocess.DEVNULL)

    def on_term(signum: int, frame: FrameType | None) -> Any:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        wait_healthy(url, proc, STARTUP_TIMEOUT_S)
        print(f"tpudiag dashboard: {url}  (store {path}; Ctrl-C to stop)", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def register(sub: Any) -> None:
    p = sub.add_parser(
        "dashboard",
        help="open the dashboard (Streamlit) on a store: runs, slow ops, numerics, compile, compare",
        description="Serve the tpudiag dashboard and print its URL. It reads the store only, picks up runs "
        "captured while it is open, and listens on 127.0.0.1 unless --host says otherwise.",
    )
    p.add_argument("--db", help="store path (default: $TPUDIAG_DB or ./tpudiag.duckdb)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--remote",
        metavar="URL",
        help="show a run straight from a bucket (gs://, s3://, file://) that `capture --remote` uploaded to: its "
        "summaries are read with DuckDB over the bucket's Parquet, nothing is copied but them",
    )
    p.add_argument("--run", metavar="ID", help="with --remote: the run to show (default: the newest)")
    p.set_defaults(func=cmd_dashboard)
