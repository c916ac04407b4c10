"""Reading the text torch writes about a compilation: recompile reasons, graph-break messages, guard sources."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MAX_TEXT = 4000

_GB_LOCATION = re.compile(r"Graph break in user code at (.+):(\d+)")
_TB_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')
_RECOMPILE_PREFIX = re.compile(r"^\d+/\d+: ", re.MULTILINE)
_PLAIN_SOURCE = re.compile(r"^L\['([^']+)'\]((?:\[\d+\])*)$")


def clip(text: str | None, limit: int = MAX_TEXT) -> str | None:
    if text is None:
        return None
    return text if len(text) <= limit else text[:limit] + "..."


_OWN_DIR = os.path.dirname(os.path.abspath(__file__ or "")).replace("\\", "/").rsplit("/analysis", 1)[0] + "/"


def is_torch_internal(path: str | None) -> bool:
    """A file of torch itself (a wrapper frame such as ``external_utils.inner``) or of tpudiag (the module-call
    wrapper sits on the stack of every compiled module call during a capture), not the user's code."""
    if not path:
        return False
    p = path.replace("\\", "/")
    return "-packages/torch/" in p or "/torch/_dynamo/" in p or p.startswith(_OWN_DIR)


def recompile_reasons(text: str | None) -> list[str]:
    """``"0/0: tensor 'x' size mismatch ...\\n0/1: ..."`` -> one reason per failed cache entry.

    Only the first line of each entry is kept (later lines repeat the user stack of the guard).
    """
    if not text:
        return []
    out: list[str] = []
    for chunk in _RECOMPILE_PREFIX.split(text.strip()):
        line = chunk.strip().splitlines()[0].strip() if chunk.strip() else ""
        # Guards print their source as a trailing "# code  # file:line in fn" comment.
        line = re.sub(r"\s{2,}#.*$", "", line).strip()
        if line and line not in out:
            out.append(line)
    return out


@dataclass(frozen=True)
class GraphBreak:
    file: str | None
    line: int | None
    function: str | None
    reason: str
    message: str


def parse_graph_break(text: str) -> GraphBreak:
    """A ``dynamo_graph_break_reason`` payload -> where the break is in user code and why (one line)."""
    file: str | None = None
    line: int | None = None
    function: str | None = None
    m = _GB_LOCATION.search(text)
    if m:
        file, line = m.group(1), int(m.group(2))
    head, _, _ = text.partition("Traceback (most recent call last)")
    user_part = head.partition("User code traceback:")[2]
    frames = [f for f in (_TB_FRAME.match(s) for s in user_part.splitlines()) if f]
    if frames:
        file, line, function = frames[-1].group(1), int(frames[-1].group(2)), frames[-1].group(3).strip()
    body = head.partition("Graph Break Reason:")[2] or head
    lines = [s.strip() for s in body.splitlines() if s.strip()]
    # Line 1 says what Dynamo was doing ("Encountered graph break when ..."); then the graph-break type and
    # its "Explanation:" line, the two parts that read as a reason.
    if lines and lines[0].startswith(("Encountered graph break", "Failed to handle graph break")) and len(lines) > 1:
        lines = lines[1:]
    reason = lines[0] if lines else "graph break"
    if len(lines) > 1 and lines[1].startswith("Explanation:"):
        reason += ": " + lines[1].removeprefix("Explanation:").strip()
    return GraphBreak(file, line, function, reason, clip(head.strip()) or "")


def source_name(source: str) -> str | None:
    """``L['x']`` -> ``x``, ``L['args'][0]`` -> ``args[0]``; parameters, buffers and attributes -> None."""
    m = _PLAIN_SOURCE.match(source)
    return m.group(1) + m.group(2) if m else None
