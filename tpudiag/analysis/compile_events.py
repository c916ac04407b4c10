"""Torch structured-trace records -> CompileEvents: one interpretation for live capture and file import.

``torch._logging.trace_structured`` emits one record per compile step: a metadata dict keyed by the event
name (plus ``frame_id``/``frame_compile_id``/``attempt``/``rank``) and an optional text payload.  The compile
collector receives them from a logging handler, the TORCH_TRACE reader from the
``dedicated_log_torch_trace_*.log`` files; both feed the same ``CompileEventBuilder`` in the order torch
emitted them, so both produce the same events.

What becomes an event (``CompileEvent.kind``):

- ``compile`` / ``recompile``: one per ``compilation_metrics`` (one Dynamo frame compilation); a recompile has
  a guard-failure reason.  ``failed`` when Dynamo or the backend gave up (``fail_type``).  Duration is
  ``entire_frame_compile_time_s``; shapes are the frame's tensor inputs (``describe_tensor``/``_source``).
- ``backward_compile``: ``bwd_compilation_metrics`` (AOTAutograd compiles the backward graph lazily).
- ``graph_break``: ``dynamo_graph_break_reason`` artifacts, with the user source line of the break.  A break
  in a frame whose compilation then failed is not counted (torch counts it as unimplemented, not as a graph
  break).
- ``cache``: Inductor FX graph cache and AOTAutograd cache hit/miss/bypass artifacts (``cache_tier``).
- ``tpu_eager``: a TorchTPU eager executable-cache lookup (``torchtpu_eager_aten_graph`` artifact:
  ``op_name``, ``cache_hit``, ``compile_failed``, materialisation ``reason``), timed by the ``chromium_event``
  X-event TorchTPU emits just before it.  The paired ``torchtpu_eager_stablehlo`` artifact is the same lookup.
- ``tpu_graph``: ``torchtpu_fx_graph`` / ``torchtpu_stablehlo_graph`` artifacts of
  ``torch.compile(backend="tpu")``.

Events of one Dynamo compilation are held until its ``compilation_metrics`` arrives, so they carry its frame.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tpudiag.analysis.compile_text import clip, is_torch_internal, parse_graph_break, recompile_reasons, source_name
from tpudiag.model import CompileEvent

CACHE_ARTIFACTS: dict[str, tuple[str, bool | None]] = {
    "fx_graph_cache_hit": ("inductor_fx", True),
    "fx_graph_cache_miss": ("inductor_fx", False),
    "fx_graph_cache_bypass": ("inductor_fx", None),
    "aotautograd_cache_hit": ("aotautograd", True),
    "aotautograd_cache_miss": ("aotautograd", False),
    "aotautograd_cache_bypass": ("aotautograd", None),
}
TPU_EAGER_ARTIFACT = "torchtpu_eager_aten_graph"
TPU_EAGER_PAIR = "torchtpu_eager_stablehlo"
TPU_GRAPH_ARTIFACTS = ("torchtpu_fx_graph", "torchtpu_stablehlo_graph")
GRAPH_BREAK_ARTIFACT = "dynamo_graph_break_reason"

# Artifacts whose payload the builder reads; other payloads (graphs, code, guards) are never decoded.
_PAYLOAD_ARTIFACTS = frozenset([*CACHE_ARTIFACTS, TPU_EAGER_ARTIFACT, *TPU_GRAPH_ARTIFACTS, GRAPH_BREAK_ARTIFACT])
MAX_INPUTS = 16


@dataclass
class _Pending:
    """What one Dynamo compilation (frame_id, frame_compile_id) has told so far."""

    stack: list[dict[str, Any]] = field(default_factory=list)
    tensors: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    inputs: dict[str, list[Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)  # CompileEvent fields, seq assigned on release


@dataclass(frozen=True)
class Frame:
    function: str | None
    file: str | None
    line: int | None


class CompileEventBuilder:
    """Feed structured-trace records in emission order; collect CompileEvents.

    ``feed`` returns the events completed by that record (usually none); ``finish`` releases what is still
    held (a compilation cut short by the end of the run).  ``seq`` numbers events in release order.
    """

    def __init__(self, run_id: str, rank: int = 0, first_seq: int = 0) -> None:
        self.run_id = run_id
        self.rank = rank
        self._seq = first_seq
        self._strings: dict[int, str] = {}
        self._pending: dict[tuple[int | None, int | None, int | None], _Pending] = {}
        self._frames: dict[tuple[int | None, int | None, int | None], Frame] = {}
        self._tpu_dur_s: float | None = None
        self.records = 0

    @property
    def next_seq(self) -> int:
        return self._seq

    @staticmethod
    def wants_payload(metadata: Mapping[str, Any]) -> bool:
        """Whether ``feed`` reads this record's payload (the file reader skips the others' payload lines)."""
        if "compilation_metrics" in metadata or "bwd_compilation_metrics" in metadata:
            return False
        art = metadata.get("artifact")
        if isinstance(art, Mapping):
            return art.get("name") in _PAYLOAD_ARTIFACTS or art.get("name") == "recompile_reasons"
        return "chromium_event" in metadata and "frame_id" not in metadata

    # -- input ----------------------------------------------------------------------------------------------
    def feed(self, metadata: Mapping[str, Any], payload: str | None, ts_ns: int | None) -> list[CompileEvent]:
        self.records += 1
        if "str" in metadata:
            value = metadata["str"]
            if isinstance(value, (list, tuple)) and len(value) == 2:
                self._strings[int(value[1])] = str(value[0])
            return []
        if "chromium_event" in metadata:
            self._chromium(metadata, payload)
            return []
        key = (
            metadata.get("compiled_autograd_id"),
            metadata.get("frame_id"),
            metadata.get("frame_compile_id"),
        )
        rank = int(metadata.get("rank", self.rank) or 0)
        if "compilation_metrics" in metadata:
            return self._metrics(key, metadata["compilation_metrics"], metadata, rank, backward=False)
        if "bwd_compilation_metrics" in metadata:
            return self._metrics(key, metadata["bwd_compilation_metrics"], metadata, rank, backward=True)
        if "dynamo_start" in metadata:
            self._pend(key).stack = list(metadata["dynamo_start"].get("stack") or [])
            return []
        if "describe_tensor" in metadata:
            t = metadata["describe_tensor"]
            self._pend(key).tensors[(t.get("describer_id", 0), t.get("id", 0))] = list(t.get("size") or [])
            return []
        if "describe_source" in metadata:
            s = metadata["describe_source"]
            pend = self._pend(key)
            name = source_name(str(s.get("source", "")))
            size = pend.tensors.get((s.get("describer_id", 0), s.get("id", 0)))
            if name is not None and size is not None and len(pend.inputs) < MAX_INPUTS:
                pend.inputs[name] = size
            return []
        art = metadata.get("artifact")
        if isinstance(art, Mapping):
            return self._artifact(key, art, metadata, payload, ts_ns, rank)
        return []

    def finish(self) -> list[CompileEvent]:
        out: list[CompileEvent] = []
        for key in list(self._pending):
            out += self._release(key, None, failed=False)
        return out

    # -- records --------------------------------------------------------------------------------------------
    def _pend(self, key: tuple[int | None, int | None, int | None]) -> _Pending:
        pend = self._pending.get(key)
        if pend is None:
            pend = self._pending[key] = _Pending()
        return pend

    def _chromium(self, metadata: Mapping[str, Any], payload: str | None) -> None:
        # TorchTPU's eager batches come as complete ("X") events outside any compile context, right before
        # their artifacts; Dynamo's own B/E events carry a frame id and are not needed here.
        if "frame_id" in metadata or not payload:
            return
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if isinstance(event, dict) and event.get("ph") == "X" and isinstance(event.get("dur"), (int, float)):
            self._tpu_dur_s = float(event["dur"]) / 1e6

    def _artifact(
        self,
        key: tuple[int | None, int | None, int | None],
        art: Mapping[str, Any],
        metadata: Mapping[str, Any],
        payload: str | None,
        ts_ns: int | None,
        rank: int,
    ) -> list[CompileEvent]:
        name = art.get("name")
        base: dict[str, Any] = {
            "ts_ns": ts_ns,
            "rank": rank,
            "frame_id": key[1],
            "attempt": metadata.get("attempt"),
        }
        if key[1] is not None:
            base["compile_id"] = _compile_id(key)
        if name == TPU_EAGER_ARTIFACT:
            dur, self._tpu_dur_s = self._tpu_dur_s, None
            failed = bool(art.get("compile_failed", False))
            body: dict[str, Any] = {
                "compile_failed": failed,
                "aten_graph": clip(payload) if not art.get("cache_hit") else None,
            }
            event = {
                **base,
                "kind": "tpu_eager",
                "function": art.get("op_name"),
                "cache_tier": "tpu_eager",
                "cache_hit": _bool(art.get("cache_hit")),
                "reason": art.get("reason"),
                "duration_s": dur,
                "failed": failed,
                "payload": json.dumps(body),
            }
            return self._emit(key, event)
        if name == TPU_EAGER_PAIR:
            return []
        if name in TPU_GRAPH_ARTIFACTS:
            text = payload or ""
            graph = {
                "artifact": name,
                "chars": len(text),
                "lines": text.count("\n") + 1,
                "head": clip(text),
            }
            return self._emit(key, {**base, "kind": "tpu_graph", "reason": name, "payload": json.dumps(graph)})
        if name in CACHE_ARTIFACTS:
            tier, hit = CACHE_ARTIFACTS[str(name)]
            info = _json_object(payload)
            reason = info.get("cache_bypass_reason") or info.get("reason") or info.get("cache_status_detailed")
            keep = {
                k: info[k]
                for k in (
                    "key",
                    "cache_status_detailed",
                    "cache_state",
                    "time_saved_ms",
                    "cache_bypass_reason",
                    "cache_status_guard_expr",
                )
                if k in info
            }
            event = {
                **base,
                "kind": "cache",
                "cache_tier": tier,
                "cache_hit": hit,
                "reason": None if reason is None else str(reason),
                "payload": json.dumps(keep),
            }
            return self._emit(key, event)
        if name == GRAPH_BREAK_ARTIFACT and payload:
            gb = parse_graph_break(payload)
            event = {
                **base,
                "kind": "graph_break",
                "function": gb.function,
                "file": gb.file,
                "line": gb.line,
                "reason": gb.reason,
                "payload": json.dumps({"message": gb.message}),
            }
            self._pend(key).events.append(event)  # dropped if this compilation fails, see _release
            return []
        return []

    def _emit(self, key: tuple[int | None, int | None, int | None], event: dict[str, Any]) -> list[CompileEvent]:
        """An event of a running compilation waits for its frame; others are complete now."""
        if key[1] is not None and key in self._pending:
            self._pending[key].events.append(event)
            return []
        frame = self._frames.get(key)
        if frame is not None and event.get("function") is None:
            event.update(function=frame.function, file=frame.file, line=frame.line)
        return [self._make(event)]

    def _metrics(
        self,
        key: tuple[int | None, int | None, int | None],
        m: Mapping[str, Any],
        metadata: Mapping[str, Any],
        rank: int,
        backward: bool,
    ) -> list[CompileEvent]:
        start_us = m.get("start_time_us")
        start_s = m.get("start_time")
        ts_ns = (
            int(start_us) * 1000
            if isinstance(start_us, int)
            else (int(float(start_s) * 1e9) if isinstance(start_s, (int, float)) else None)
        )
        failed = m.get("fail_type") is not None
        pend = self._pending.get(key) or _Pending()
        if backward:
            duration = _first_number(m, "entire_frame_compile_time_s", "inductor_compile_time_s")
            if duration is None and isinstance(m.get("duration_us"), (int, float)):
                duration = float(m["duration_us"]) / 1e6
            frame = self._frames.get(key, Frame(None, None, None))
            event: dict[str, Any] = {
                "kind": "backward_compile",
                "duration_s": duration,
                "failed": failed,
                "reason": _fail_reason(m) if failed else None,
            }
        else:
            frame = self._frame_of(m, pend)
            self._frames[key] = frame
            reasons = recompile_reasons(m.get("recompile_reason"))
            restarts = [str(r).strip().splitlines()[0] for r in m.get("restart_reasons") or [] if str(r).strip()]
            body = {
                "co_name": m.get("co_name"),
                "co_filename": m.get("co_filename"),
                "co_firstlineno": m.get("co_firstlineno"),
                "recompile_reasons": reasons,
                "restart_reasons": restarts,
                "cache_size": m.get("cache_size"),
                "guard_count": m.get("guard_count"),
                "graph_op_count": m.get("graph_op_count"),
                "backend_compile_time_s": m.get("backend_compile_time_s"),
                "inductor_compile_time_s": m.get("inductor_compile_time_s"),
                "fail_type": m.get("fail_type"),
                "fail_reason": clip(m.get("fail_reason")),
                "call_site": _call_site(pend.stack, self._strings),
            }
            is_recompile = bool(reasons) or (key[2] or 0) > 0
            event = {
                "kind": "recompile" if is_recompile else "compile",
                "duration_s": _first_number(m, "entire_frame_compile_time_s"),
                "reason": _fail_reason(m) if failed else (reasons[0] if reasons else None),
                "failed": failed,
                "payload": json.dumps(body, default=str),
                "shapes": json.dumps(pend.inputs, separators=(",", ":")) if pend.inputs else None,
            }
        event.update(
            ts_ns=ts_ns,
            rank=rank,
            frame_id=key[1],
            attempt=metadata.get("attempt"),
            compile_id=str(m.get("compile_id") or _compile_id(key)),
            function=frame.function,
            file=frame.file,
            line=frame.line,
        )
        return self._release(key, event, failed=failed)

    def _frame_of(self, m: Mapping[str, Any], pend: _Pending) -> Frame:
        frame = Frame(m.get("co_name"), m.get("co_filename"), m.get("co_firstlineno"))
        if not is_torch_internal(frame.file):
            return frame
        # torch.compile(module) compiles a wrapper inside torch; the user's call site names it better.
        for entry in reversed(pend.stack):
            path = self._strings.get(entry.get("filename", -1)) if isinstance(entry.get("filename"), int) else None
            if path and not is_torch_internal(path):
                return Frame(str(entry.get("name")), path, entry.get("line"))
        return frame

    def _release(
        self, key: tuple[int | None, int | None, int | None], final: dict[str, Any] | None, failed: bool
    ) -> list[CompileEvent]:
        pend = self._pending.pop(key, None)
        frame = self._frames.get(key)
        out: list[CompileEvent] = []
        for event in pend.events if pend else []:
            if failed and event["kind"] == "graph_break":
                continue
            if frame is not None and event.get("function") is None:
                event.update(function=frame.function, file=frame.file, line=frame.line)
            out.append(self._make(event))
        if final is not None:
            out.append(self._make(final))
        return out

    def _make(self, fields: dict[str, Any]) -> CompileEvent:
        event = CompileEvent(run_id=self.run_id, seq=self._seq, **{"rank": self.rank, **fields})
        self._seq += 1
        return event


def _compile_id(key: tuple[int | None, int | None, int | None]) -> str:
    ca, frame_id, frame_compile_id = key
    base = f"{frame_id}/{frame_compile_id}"
    return f"!{ca}/{base}" if ca is not None else base


def _bool(value: Any) -> bool | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)


def _json_object(payload: str | None) -> dict[str, Any]:
    if not payload:
        return {}
    try:
        value = json.loads(payload)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _first_number(m: Mapping[str, Any], *keys: str) -> float | None:
    for k in keys:
        v = m.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _fail_reason(m: Mapping[str, Any]) -> str:
    reason = str(m.get("fail_reason") or "").strip().splitlines()
    return f"{m.get('fail_type')}: {reason[0]}" if reason else str(m.get("fail_type"))


def _call_site(stack: list[dict[str, Any]], strings: Mapping[int, str]) -> str | None:
    """The first frame of the compile's stack that is not torch's: where the user called the compiled code."""
    for entry in stack:
        fname = entry.get("filename")
        path = strings.get(fname) if isinstance(fname, int) else None
        if path and not is_torch_internal(path):
            return f"{path}:{entry.get('line')}"
    return None
