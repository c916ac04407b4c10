"""CI channels: GitHub Actions annotations, the markdown job summary, JUnit XML.

GitHub keeps at most 10 annotations of each type per step and drops the rest silently, so at most
``MAX_ANNOTATIONS`` are printed, most severe first, and one more line says how many were left out.  The job
summary is capped below GitHub's 1 MiB per step.  JUnit XML is plain ``testsuite``/``testcase`` elements (no
``record_property``), which every CI reader accepts.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

MAX_ANNOTATIONS = 10
MAX_SUMMARY_BYTES = 1000 * 1024
LEVELS = {"error": "error", "warning": "warning", "notice": "notice"}


class Annotated(Protocol):
    @property
    def severity(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def file(self) -> str | None: ...
    @property
    def line(self) -> int | None: ...


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(items: Sequence[Annotated], limit: int = MAX_ANNOTATIONS) -> list[str]:
    """``::error file=..,line=..,title=..::message`` lines for the most severe items (input order kept)."""
    lines = []
    for f in items[:limit]:
        props = []
        if f.file:
            props.append(f"file={_escape_property(f.file)}")
            if f.line:
                props.append(f"line={f.line}")
        props.append(f"title={_escape_property(f.title)}")
        lines.append(f"::{LEVELS.get(f.severity, 'notice')} {','.join(props)}::{_escape_data(f.message)}")
    if len(items) > limit:
        rest = items[limit:]
        kinds = ", ".join(
            f"{sum(1 for f in rest if f.severity == s)} {s}" for s in LEVELS if any(f.severity == s for f in rest)
        )
        lines.append(
            f"::notice title=tpudiag::{len(rest)} more finding(s) not annotated ({kinds}): see the job summary"
        )
    return lines


def write_step_summary(markdown: str, env: dict[str, str] | None = None) -> Path | None:
    """Append ``markdown`` to ``$GITHUB_STEP_SUMMARY`` when it is set; returns the path written, if any."""
    target = (env if env is not None else dict(os.environ)).get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    data = markdown.encode()
    if len(data) > MAX_SUMMARY_BYTES:
        data = data[:MAX_SUMMARY_BYTES].rsplit(b"\n", 1)[0] + b"\n\n(summary cut at 1000 KiB)\n"
    path = Path(target)
    with path.open("ab") as fh:
        fh.write(data + b"\n")
    return path


def junit_xml(suite: str, cases: Sequence[dict[str, Any]]) -> str:
    """``cases``: {name, classname, status: pass|fail|inconclusive|skipped, message, detail}."""
    root = ET.Element(
        "testsuite",
        name=suite,
        tests=str(len(cases)),
        failures=str(sum(1 for c in cases if c["status"] == "fail")),
        errors="0",
        skipped=str(sum(1 for c in cases if c["status"] in ("skipped", "inconclusive"))),
    )
    for c in cases:
        case = ET.SubElement(root, "testcase", name=c["name"], classname=c.get("classname", suite))
        if c["status"] == "fail":
            el = ET.SubElement(case, "failure", message=c.get("message", ""))
            el.text = c.get("detail") or c.get("message", "")
        elif c["status"] in ("skipped", "inconclusive"):
            ET.SubElement(case, "skipped", message=f"{c['status']}: {c.get('message', '')}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
