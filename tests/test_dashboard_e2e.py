"""``tpudiag dashboard`` for real: bad input gives one line; a captured example opens in headless Chromium.

The browser test needs Debian's chromium (``apt-get install chromium``; CI installs it) and skips without it.
Screenshots land in ``test-artifacts/``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EXAMPLES, REPO, run_tpudiag
from tests.factories import make_run
from tests.test_dashboard_fixtures import HOSTILE, trace_run, with_numerics
from tpudiag.store import Store, queries
from tpudiag.store import dashboard_queries as q

# Found as .ci/run finds it (`command -v chromium`), wherever the system put it.
_found = shutil.which("chromium")
CHROMIUM = Path(_found) if _found else None
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
ARTIFACTS = REPO / "test-artifacts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("tpudiag: error: "), proc.stderr
    return lines[0]


def test_dashboard_rejects_a_directory(tmp_path: Path) -> None:
    proc = run_tpudiag("dashboard", "--db", str(tmp_path), timeout=60)
    assert proc.returncode == 3
    assert "is a directory" in one_error_line(proc)


def test_dashboard_rejects_a_foreign_file(tmp_path: Path) -> None:
    junk = tmp_path / "notes.duckdb"
    junk.write_text("not a database\n")
    proc = run_tpudiag("dashboard", "--db", str(junk), timeout=60)
    assert proc.returncode == 3
    assert "not a tpudiag store" in one_error_line(proc)


def test_dashboard_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_tpudiag("dashboard", "--db", str(tmp_path / "s.duckdb"), "--port", str(port), timeout=60)
    assert proc.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in one_error_line(proc)
    proc = run_tpudiag("dashboard", "--port", "70000", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "--port must be between" in one_error_line(proc)


@contextlib.contextmanager
def serving(db: Path) -> Iterator[str]:
    """``tpudiag dashboard`` on a free port; yields its URL once printed; stops it with SIGTERM."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TPUDIAG_DB"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpudiag", "dashboard", "--db", str(db), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the command prints its URL once the server answers
        assert line.startswith(f"tpudiag dashboard: http://127.0.0.1:{port}"), (line, proc.poll())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    # The streamlit child went with it: nothing listens on the port any more (TIME_WAIT aside).
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def browser() -> Any:
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    return sync_playwright()


def svg_text(page: Any, text: str, timeout_s: float = 30) -> None:
    """Wait until a chart (SVG) shows ``text`` literally."""
    page.locator("svg text", has_text=text).first.wait_for(state="attached", timeout=timeout_s * 1000)


def store_has_numerics(store: Store, run_id: str) -> bool:
    return bool(q.load_numerics(store, run_id).coverage["ops_seen"])


@pytest.mark.slow
def test_captured_example_in_chromium(tmp_path: Path) -> None:
    with browser() as pw:
        db = tmp_path / "store.duckdb"
        cap = run_tpudiag("capture", "--db", str(db), str(EXAMPLES / "train_mlp.py"), "--epochs", "1",
                          "--batches", "4", cwd=tmp_path)  # fmt: skip
        assert cap.returncode == 0, cap.stderr
        store = Store(db)
        run = queries.resolve_run(store, None)
        top = q.load_slow_ops(store, run["id"], "op", limit=1).top
        assert top, f"the capture recorded no op events (run notes: {run['notes']})"
        slowest = top[0]["name"]
        first = q.load_numerics(store, run["id"]).first_divergence
        ARTIFACTS.mkdir(exist_ok=True)
        with serving(db) as url:
            chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = chromium.new_page(viewport={"width": 1500, "height": 1100})
            t0 = time.monotonic()
            page.goto(f"{url}/slow-ops?run={run['id']}")
            page.get_by_text("Top ops by self time").first.wait_for(timeout=30_000)
            svg_text(page, slowest)
            loaded_s = time.monotonic() - t0
            page.wait_for_timeout(1500)  # let the remaining charts draw before the screenshot
            page.screenshot(path=str(ARTIFACTS / "dashboard-slow-ops.png"))
            # The op detail below the charts names the slowest op in plain text.
            assert page.get_by_text(slowest, exact=True).count() >= 1
            page.goto(f"{url}/numerics?run={run['id']}")
            page.get_by_role("heading", name="Numerics").wait_for(timeout=30_000)
            if first is not None:
                page.get_by_text("First divergence").first.wait_for(timeout=30_000)
                assert page.locator("code", has_text=str(first["op"])).count() >= 1
            else:
                page.get_by_text("No numerics").or_(page.get_by_text("No divergent op")).first.wait_for(timeout=30_000)
            if store_has_numerics(store, run["id"]):
                page.get_by_text("Ops checked").first.wait_for(timeout=30_000)
                page.locator(".js-plotly-plot").first.wait_for(state="attached", timeout=30_000)
            page.wait_for_timeout(2500)
            page.screenshot(path=str(ARTIFACTS / "dashboard-numerics.png"))
            chromium.close()
        assert loaded_s < 30


@pytest.mark.slow
def test_hostile_names_render_as_text(tmp_path: Path) -> None:
    with browser() as pw:
        store = Store(tmp_path / "store.duckdb")
        hostile_run = make_run(name=HOSTILE, script=HOSTILE)
        img = {"aten::mm": "<img src=x onerror=alert(1)>"}
        built = with_numerics(
            trace_run(hostile_run, op_names=img, modules=("<b>b</b>",)),
            fail_at=5, op_name="<script>op</script>", module="'; DELETE FROM ops; --",
        )  # fmt: skip
        built.write(store)
        dialogs: list[str] = []
        with serving(store.path) as url:
            chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = chromium.new_page(viewport={"width": 1500, "height": 1100})

            def on_dialog(dialog: Any) -> None:
                dialogs.append(dialog.message)
                dialog.dismiss()

            page.on("dialog", on_dialog)
            page.goto(f"{url}/slow-ops?run={built.run.id}")
            svg_text(page, "<img src=x onerror=alert(1)>")
            assert page.get_by_text(f"{HOSTILE} · {built.run.id} · ok", exact=True).count() == 1
            page.goto(f"{url}/numerics?run={built.run.id}")
            page.get_by_text("First divergence").first.wait_for(timeout=30_000)
            card = page.locator("code", has_text="<script>op</script>").first
            card.wait_for(timeout=10_000)
            assert "module  '; DELETE FROM ops; --" in card.inner_text()
            page.wait_for_timeout(1500)
            page.screenshot(path=str(ARTIFACTS / "dashboard-hostile.png"))
            injected = page.evaluate(
                """() => ({
                    img: document.querySelectorAll('img[src="x"]').length,
                    bold: [...document.querySelectorAll('b')].filter(b => b.textContent === 'b').length,
                    script: [...document.scripts].filter(s => s.textContent.includes("alert")).length,
                })"""
            )
            chromium.close()
        assert injected == {"img": 0, "bold": 0, "script": 0}
        assert dialogs == []
