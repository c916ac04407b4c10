"""Helpers that exist once and serve several callers: ``--numerics``/``--budget`` values (CLI and collector), the
varint reader (file sniffing and the column decoder), the stderr status line (import, export, log reading), and
the numerics collector's one progress thread."""

from __future__ import annotations

import contextlib
import io
import textwrap
from pathlib import Path

import pytest
from google.protobuf.internal import decoder, encoder
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import run_tpudiag
from tpudiag.cli import build_parser
from tpudiag.collectors.numerics.sampling import parse_options
from tpudiag.errors import UsageError
from tpudiag.progress import Progress, StatusLine
from tpudiag.traces import detect, protowire


@pytest.mark.parametrize("value", ["sample", "all", "OFF", "5", "first:2", "zz", "0", "-3", "first:0", "2.5"])
def test_cli_and_collector_accept_the_same_numerics_values(value: str) -> None:
    cli_err = io.StringIO()
    with contextlib.redirect_stderr(cli_err), contextlib.suppress(SystemExit):
        build_parser().parse_args(["capture", "--numerics", value])
    try:
        opts = parse_options({"numerics": value})
    except UsageError as err:
        # Refused by both, with the same explanation.
        assert str(err).removeprefix("--numerics ") in cli_err.getvalue(), (str(err), cli_err.getvalue())
        assert "expected sample, all, off" in str(err)
    else:
        assert cli_err.getvalue() == "", cli_err.getvalue()
        assert opts.mode in ("sample", "all", "off") and opts.first_k >= 1


@pytest.mark.parametrize("value", ["20", "20%", "0.5", "0", "-1", "x", "nan"])
def test_cli_and_collector_accept_the_same_budgets(value: str) -> None:
    cli_err = io.StringIO()
    args = None
    with contextlib.redirect_stderr(cli_err), contextlib.suppress(SystemExit):
        args = build_parser().parse_args(["capture", "--budget", value])
    try:
        opts = parse_options({"budget": value})
    except UsageError as err:
        assert args is None and str(err).removeprefix("--budget ") in cli_err.getvalue()
    else:
        assert args is not None and args.budget == opts.budget_pct == float(value.rstrip("%"))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1), st.binary(max_size=4), st.binary(max_size=4))
def test_varint_at_equals_protobufs_own_decoder(value: int, before: bytes, after: bytes) -> None:
    chunks: list[bytes] = []
    encoder._EncodeVarint(chunks.append, value)
    data = before + b"".join(chunks) + after
    expected = decoder._DecodeVarint(data, len(before))
    assert protowire.varint_at(data, len(before)) == expected
    # Cut inside the varint: no value.
    assert protowire.varint_at(data[: expected[1] - 1], len(before)) is None


def test_varint_at_refuses_overlong_and_the_sniffer_uses_it() -> None:
    assert protowire.varint_at(b"\xff" * 12, 0) is None
    assert protowire.varint_at(b"", 0) is None
    # An XSpace is field 1 (planes), length-delimited: the length must fit in the file.
    body = b"\x0a\x96\x01" + b"x" * 150
    assert detect.looks_like_xspace(body, len(body))
    assert not detect.looks_like_xspace(body, len(body) - 1)
    assert not detect.looks_like_xspace(b"\x0a\x96", 10**6)  # length cut off


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_rewrites_in_place_on_a_terminal_and_prints_lines_on_a_pipe() -> None:
    tty, pipe = _Terminal(), io.StringIO()
    for stream in (tty, pipe):
        line = StatusLine(stream, interval_s=3600)
        line("reading a")
        line("reading b")  # throttled
        line("reading c", force=True)
        line.done()
    assert tty.getvalue() == "\rtpudiag: reading a\x1b[K\rtpudiag: reading c\x1b[K\n"
    assert pipe.getvalue() == "tpudiag: reading a\ntpudiag: reading c\n"


def test_export_progress_is_live_on_a_terminal_and_one_closing_line_on_a_pipe() -> None:
    tty, pipe = _Terminal(), io.StringIO()
    for stream in (tty, pipe):
        p = Progress("export x", 3, stream)
        p.advance(2)
        p.advance(1)
        p.finish()
    assert tty.getvalue().startswith("\rtpudiag: export x: 2/3 events\x1b[K\rtpudiag: export x: 3 events in ")
    assert pipe.getvalue().startswith("tpudiag: export x: 3 events in ") and pipe.getvalue().count("\n") == 1


def test_numerics_collector_runs_one_progress_thread(tmp_path: Path) -> None:
    script = tmp_path / "threads.py"
    script.write_text(
        textwrap.dedent("""
        import threading, torch
        torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum()
        print("progress threads", sum(t.name == "tpudiag-numerics" for t in threading.enumerate()))
        """)
    )
    db = tmp_path / "s.duckdb"
    proc = run_tpudiag("capture", "--db", str(db), "--collect", "numerics", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "progress threads 1\n" in proc.stdout, proc.stdout


def test_only_the_status_line_module_rewrites_stderr_in_place() -> None:
    """One progress line: the erase-to-end-of-line sequence appears in tpudiag/progress.py and nowhere else."""
    repo = Path(__file__).resolve().parents[1]
    writers = sorted(
        str(p.relative_to(repo))
        for folder in ("tpudiag", "collectors", "app")
        for p in (repo / folder).rglob("*.py")
        if not p.is_relative_to(repo / "tpudiag" / "collectors")
        and not p.is_relative_to(repo / "tpudiag" / "app")
        and ("\\x1b[K" in p.read_text() or "\\033[K" in p.read_text())
    )
    assert writers == ["tpudiag/progress.py"]
