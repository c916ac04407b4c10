"""XPlane protobuf messages (XSpace, XPlane, XLine, XEvent, XStat, ...) built at run time from a descriptor.

No Python module for ``xplane.proto`` ships with xprof or tensorboard, and we commit no generated code: the
descriptor below is written by hand from openxla/xla ``xla/tsl/profiler/protobuf/xplane.proto`` (package
``tensorflow.profiler``, proto3; field numbers must match that file exactly, since they are the wire format).
The classes live in a private descriptor pool, so they never clash with a TensorFlow or xprof that registers
the same names in the default pool.

Builders (``PlaneBuilder``) intern event and stat metadata by name, the way XPlane writers do (each XPlane has
its own id -> metadata maps), so callers write ``plane.add_event(line, "fusion.1", offset_ps, duration_ps)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tensorflow.profiler"
_F = descriptor_pb2.FieldDescriptorProto

StatValue = int | float | str | bytes | bool


def _field(
    msg: descriptor_pb2.DescriptorProto,
    name: str,
    number: int,
    ftype: int,
    repeated: bool = False,
    type_name: str | None = None,
    oneof: int | None = None,
) -> None:
    f = msg.field.add(name=name, number=number, type=ftype)
    f.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
    if type_name:
        f.type_name = f".{PACKAGE}.{type_name}"
    if oneof is not None:
        f.oneof_index = oneof


def _map_entry(parent: descriptor_pb2.DescriptorProto, entry_name: str, value_type: str) -> None:
    entry = parent.nested_type.add(name=entry_name)
    entry.options.map_entry = True
    _field(entry, "key", 1, _F.TYPE_INT64)
    _field(entry, "value", 2, _F.TYPE_MESSAGE, type_name=value_type)


def _plane_and_line(fd: descriptor_pb2.FileDescriptorProto, prefix: str) -> Any:
    """Add ``{prefix}XPlane`` and ``{prefix}XLine`` (every field but the line's ``events``); returns the line."""
    plane = fd.message_type.add(name=f"{prefix}XPlane")
    _field(plane, "id", 1, _F.TYPE_INT64)
    _field(plane, "name", 2, _F.TYPE_STRING)
    _field(plane, "lines", 3, _F.TYPE_MESSAGE, repeated=True, type_name=f"{prefix}XLine")
    _map_entry(plane, "EventMetadataEntry", "XEventMetadata")
    _field(plane, "event_metadata", 4, _F.TYPE_MESSAGE, repeated=True, type_name=f"{prefix}XPlane.EventMetadataEntry")
    _map_entry(plane, "StatMetadataEntry", "XStatMetadata")
    _field(plane, "stat_metadata", 5, _F.TYPE_MESSAGE, repeated=True, type_name=f"{prefix}XPlane.StatMetadataEntry")
    _field(plane, "stats", 6, _F.TYPE_MESSAGE, repeated=True, type_name="XStat")

    line = fd.message_type.add(name=f"{prefix}XLine")
    _field(line, "id", 1, _F.TYPE_INT64)
    _field(line, "display_id", 10, _F.TYPE_INT64)
    _field(line, "name", 2, _F.TYPE_STRING)
    _field(line, "display_name", 11, _F.TYPE_STRING)
    _field(line, "timestamp_ns", 3, _F.TYPE_INT64)
    _field(line, "duration_ps", 9, _F.TYPE_INT64)
    return line


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """``xplane.proto`` as a FileDescriptorProto (field numbers from openxla/xla)."""
    fd = descriptor_pb2.FileDescriptorProto(name="tpudiag/xplane.proto", package=PACKAGE, syntax="proto3")

    space = fd.message_type.add(name="XSpace")
    _field(space, "planes", 1, _F.TYPE_MESSAGE, repeated=True, type_name="XPlane")
    _field(space, "errors", 2, _F.TYPE_STRING, repeated=True)
    _field(space, "warnings", 3, _F.TYPE_STRING, repeated=True)
    _field(space, "hostnames", 4, _F.TYPE_STRING, repeated=True)

    line = _plane_and_line(fd, "")
    _field(line, "events", 4, _F.TYPE_MESSAGE, repeated=True, type_name="XEvent")
    for lo in (5, 6, 7, 8):
        line.reserved_range.add(start=lo, end=lo + 1)

    event = fd.message_type.add(name="XEvent")
    event.oneof_decl.add(name="data")
    _field(event, "metadata_id", 1, _F.TYPE_INT64)
    _field(event, "offset_ps", 2, _F.TYPE_INT64, oneof=0)
    _field(event, "num_occurrences", 5, _F.TYPE_INT64, oneof=0)
    _field(event, "duration_ps", 3, _F.TYPE_INT64)
    _field(event, "stats", 4, _F.TYPE_MESSAGE, repeated=True, type_name="XStat")

    stat = fd.message_type.add(name="XStat")
    stat.oneof_decl.add(name="value")
    _field(stat, "metadata_id", 1, _F.TYPE_INT64)
    _field(stat, "double_value", 2, _F.TYPE_DOUBLE, oneof=0)
    _field(stat, "uint64_value", 3, _F.TYPE_UINT64, oneof=0)
    _field(stat, "int64_value", 4, _F.TYPE_INT64, oneof=0)
    _field(stat, "str_value", 5, _F.TYPE_STRING, oneof=0)
    _field(stat, "bytes_value", 6, _F.TYPE_BYTES, oneof=0)
    _field(stat, "ref_value", 7, _F.TYPE_UINT64, oneof=0)

    emeta = fd.message_type.add(name="XEventMetadata")
    _field(emeta, "id", 1, _F.TYPE_INT64)
    _field(emeta, "name", 2, _F.TYPE_STRING)
    _field(emeta, "display_name", 4, _F.TYPE_STRING)
    _field(emeta, "metadata", 3, _F.TYPE_BYTES)
    _field(emeta, "stats", 5, _F.TYPE_MESSAGE, repeated=True, type_name="XStat")
    _field(emeta, "child_id", 6, _F.TYPE_INT64, repeated=True)

    smeta = fd.message_type.add(name="XStatMetadata")
    _field(smeta, "id", 1, _F.TYPE_INT64)
    _field(smeta, "name", 2, _F.TYPE_STRING)
    _field(smeta, "description", 3, _F.TYPE_STRING)
    return fd


def raw_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The same wire format read with each line's events left as bytes (``RawXSpace`` / ``RawXPlane`` / ``RawXLine``).

    A million ``XEvent`` objects cost seconds to walk; left as bytes, ``protowire`` decodes them column-wise.
    """
    fd = descriptor_pb2.FileDescriptorProto(
        name="tpudiag/xplane_raw.proto", package=PACKAGE, syntax="proto3", dependency=["tpudiag/xplane.proto"]
    )
    space = fd.message_type.add(name="RawXSpace")
    _field(space, "planes", 1, _F.TYPE_MESSAGE, repeated=True, type_name="RawXPlane")
    _field(space, "hostnames", 4, _F.TYPE_STRING, repeated=True)

    line = _plane_and_line(fd, "Raw")
    _field(line, "events", 4, _F.TYPE_BYTES, repeated=True)
    return fd


def _build_classes() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor())
    pool.Add(raw_file_descriptor())
    names = ("XSpace", "XPlane", "XLine", "XEvent", "XStat", "XEventMetadata", "XStatMetadata", "RawXSpace")
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{n}")) for n in names}


_CLASSES = _build_classes()
# Message classes (protobuf types are dynamic, so they are typed as Any).
XSpace: Any = _CLASSES["XSpace"]
XPlane: Any = _CLASSES["XPlane"]
XLine: Any = _CLASSES["XLine"]
XEvent: Any = _CLASSES["XEvent"]
XStat: Any = _CLASSES["XStat"]
XEventMetadata: Any = _CLASSES["XEventMetadata"]
XStatMetadata: Any = _CLASSES["XStatMetadata"]
RawXSpace: Any = _CLASSES["RawXSpace"]


def parse_xspace(data: bytes) -> Any:
    """An XSpace from serialized bytes (``<host>.xplane.pb`` files hold exactly one)."""
    space = XSpace()
    space.ParseFromString(data)
    return space


def parse_raw_xspace(data: bytes) -> Any:
    """A ``RawXSpace``: planes, metadata and lines parsed, each line's events kept as serialized ``XEvent`` bytes."""
    space = RawXSpace()
    space.ParseFromString(data)
    return space


def set_stat_value(stat: Any, value: StatValue) -> None:
    """Store a Python value in the XStat oneof that fits it (bool as int64: XPlane has no bool)."""
    if isinstance(value, bool):
        stat.int64_value = int(value)
    elif isinstance(value, int):
        if value >= 2**63:
            stat.uint64_value = value
        else:
            stat.int64_value = value
    elif isinstance(value, float):
        stat.double_value = value
    elif isinstance(value, str):
        stat.str_value = value
    elif isinstance(value, bytes):
        stat.bytes_value = value
    else:
        raise TypeError(f"unsupported XStat value type {type(value).__name__}")


def stat_value(stat: Any, plane: Any | None = None) -> StatValue | None:
    """The Python value of an XStat; ``ref_value`` resolves to the referenced stat metadata's name."""
    kind = stat.WhichOneof("value")
    if kind is None:
        return None
    if kind == "ref_value" and plane is not None:
        ref = plane.stat_metadata.get(stat.ref_value)
        return str(ref.name) if ref is not None else None
    value: StatValue = getattr(stat, kind)
    return value


class PlaneBuilder:
    """Appends lines and events to one XPlane, interning event and stat metadata by name.

    Metadata ids start at 1: id 0 is treated as "no metadata" by several XPlane consumers.
    """

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        self._event_ids: dict[tuple[str, str], int] = {
            (m.name, m.display_name): k for k, m in plane.event_metadata.items()
        }
        self._stat_ids: dict[str, int] = {m.name: k for k, m in plane.stat_metadata.items()}
        self._next_event = max(plane.event_metadata.keys(), default=0) + 1
        self._next_stat = max(plane.stat_metadata.keys(), default=0) + 1

    @classmethod
    def new(cls, space: Any, name: str, plane_id: int) -> PlaneBuilder:
        return cls(space.planes.add(id=plane_id, name=name))

    def stat_id(self, name: str) -> int:
        sid = self._stat_ids.get(name)
        if sid is None:
            sid = self._next_stat
            self._next_stat += 1
            self.plane.stat_metadata[sid].CopyFrom(XStatMetadata(id=sid, name=name))
            self._stat_ids[name] = sid
        return sid

    def event_metadata(self, name: str, display_name: str = "", stats: Mapping[str, StatValue] | None = None) -> int:
        """Id of the event metadata (name, display_name), created with ``stats`` the first time it is seen."""
        key = (name, display_name)
        mid = self._event_ids.get(key)
        if mid is not None:
            return mid
        mid = self._next_event
        self._next_event += 1
        meta = self.plane.event_metadata[mid]
        meta.id = mid
        meta.name = name
        if display_name:
            meta.display_name = display_name
        self.add_stats(meta.stats, stats)
        self._event_ids[key] = mid
        return mid

    def add_stats(self, target: Any, stats: Mapping[str, StatValue] | None) -> None:
        for key, value in (stats or {}).items():
            if value is None:
                continue
            set_stat_value(target.add(metadata_id=self.stat_id(key)), value)

    def line(self, line_id: int, name: str, timestamp_ns: int, display_name: str = "") -> Any:
        line = self.plane.lines.add(id=line_id, display_id=line_id, name=name, timestamp_ns=timestamp_ns)
        if display_name:
            line.display_name = display_name
        return line

    def add_event(
        self,
        line: Any,
        name: str,
        offset_ps: int,
        duration_ps: int,
        stats: Mapping[str, StatValue] | None = None,
        display_name: str = "",
        metadata_stats: Mapping[str, StatValue] | None = None,
    ) -> Any:
        mid = self.event_metadata(name, display_name, metadata_stats)
        event = line.events.add(metadata_id=mid, offset_ps=offset_ps, duration_ps=duration_ps)
        self.add_stats(event.stats, stats)
        return event


__all__ = [
    "PACKAGE",
    "PlaneBuilder",
    "RawXSpace",
    "XEvent",
    "XEventMetadata",
    "XLine",
    "XPlane",
    "XSpace",
    "XStat",
    "XStatMetadata",
    "file_descriptor",
    "parse_raw_xspace",
    "parse_xspace",
    "set_stat_value",
    "stat_value",
]
