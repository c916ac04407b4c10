"""The numerics closing line is said once, in one format (issue 19: a terminal showed the live status line and then
the closing line, two formats of the same counts).  The capture runs on a real pseudo-terminal so the live line is
drawn; what the terminal finally shows is reconstructed from the bytes (``\\r`` returns, ``ESC[K`` erases)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = """
import time
import torch
x = torch.randn(64, 64)
end = time.monotonic() + 2.5
while time.monotonic() < end:  # long enough for the live line (every 0.5 s on a terminal) to be drawn
    x = torch.tanh(x @ x) * 0.5
print("done")
"""


def _visible(raw: str) -> list[str]:
    """The lines a terminal shows at the end: each line's text after its last carriage return, erases applied."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        shown = line.split("\r")[-1].replace("\x1b[K", "")
        if shown:
            lines.append(shown)
    return lines


@pytest.mark.slow
def test_closing_line_is_shown_once_on_a_terminal(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(SCRIPT))
    primary, secondary = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "TPUDIAG_DB"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tpudiag",
            "capture",
            "--db",
            str(tmp_path / "s.duckdb"),
            "--collect",
            "numerics",
            str(script),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=secondary,
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(primary)
    raw = b"".join(chunks).decode(errors="replace")
    assert "\r" in raw, raw  # the live line was drawn (and then taken off)
    counts = [line for line in _visible(raw) if "ops seen" in line]
    assert len(counts) == 1, counts
    assert re.fullmatch(r"tpudiag: numerics: [\d,]+ ops seen, [\d,]+ checked, \d+ originator\(s\)", counts[0]), counts
