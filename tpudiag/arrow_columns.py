"""Arrow tables from Python lists without pyarrow's pandas check, for the script's own process.

``pa.array`` and ``pa.table`` ask pyarrow's pandas shim whether each input is a pandas object, and the shim's first
question imports pandas, if it is installed: +43 MB of RSS and ~0.7 s of CPU (on a slow 2-core VM), taken by a
capture thread holding the GIL at the first spool write, in a script that may never use pandas.  The record tables
tpudiag writes while a script runs have four column kinds (``model.column_kinds``: int64, float64, bool, string,
each nullable), which are built here from their buffers.  A column holding anything else (a float in an int
column, a subclass, a string Arrow cannot take) is left to ``pa.array``, which converts or refuses it exactly as
before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

_MAX_STRING_BYTES = (1 << 31) - 1  # Arrow's ``string`` has 32-bit offsets
# Arrow type name -> (the Python types its values may have, numpy dtype, what a null's slot holds)
_NUMERIC: dict[str, tuple[tuple[type, ...], str, int | float]] = {
    "int64": ((int,), "int64", 0),
    "double": ((float, int), "float64", 0.0),
}


def table(columns: dict[str, Any], schema: pa.Schema) -> pa.Table:
    """``pa.table(columns, schema=schema)``, the same table, without asking about pandas where it can.  A column
    may also be an Arrow array of its field's type already (``int64_array``)."""
    import pyarrow as pa

    arrays = [_as_array(columns[field.name], field.type) for field in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _as_array(values: Any, type_: pa.DataType) -> pa.Array:
    import pyarrow as pa

    if isinstance(values, pa.Array) and values.type == type_:
        return values
    return column(values, type_)


def int64_array(values: Any, valid: Any = None) -> pa.Array:
    """An int64 column from a numpy int64 array, null where ``valid`` (a numpy bool array, if given) is False."""
    import numpy as np
    import pyarrow as pa

    data = np.ascontiguousarray(values, dtype=np.int64)
    n = len(data)
    nulls = 0 if valid is None else int(n - np.count_nonzero(valid))
    validity = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    return pa.Array.from_buffers(pa.int64(), n, [validity, pa.py_buffer(data)], null_count=nulls)


def column(values: list[Any], type_: pa.DataType) -> pa.Array:
    """``pa.array(values, type=type_)`` for an int64, float64, bool or string column of Python values and None."""
    import pyarrow as pa

    built = _built(values, type_)
    return built if built is not None else pa.array(values, type=type_)


def _built(values: list[Any], type_: pa.DataType) -> pa.Array | None:
    import numpy as np
    import pyarrow as pa

    if type_ == pa.string():
        return _strings(values)
    n = len(values)
    valid = [v is not None for v in values]
    nulls = n - sum(valid)
    if nulls == n:  # (a record table's rare columns: no value in this hand-off)
        return pa.nulls(n, type_)
    validity = pa.py_buffer(np.packbits(np.array(valid, dtype=bool), bitorder="little")) if nulls else None
    present = [v for v in values if v is not None] if nulls else values
    numeric = _NUMERIC.get(str(type_))
    if numeric is not None:
        kinds, dtype, fill = numeric
        if not all(type(v) in kinds for v in present):
            return None
        try:
            data = np.array([fill if v is None else v for v in values], dtype=dtype)
        except OverflowError:
            return None
        return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(data)], null_count=nulls)
    if type_ == pa.bool_():
        if not all(type(v) is bool for v in present):
            return None
        bits = np.packbits(np.array([v is True for v in values], dtype=bool), bitorder="little")
        return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(bits)], null_count=nulls)
    return None


def _strings(values: list[Any]) -> pa.Array | None:
    """A string column, each distinct value checked and encoded once (a record table's strings repeat: a run id,
    a step's input shapes): C loops over the rows, Python ones over the distinct values."""
    import numpy as np
    import pyarrow as pa

    n = len(values)
    try:
        distinct = list(dict.fromkeys(values))
    except TypeError:  # an unhashable value: not a string
        return None
    if not all(type(v) is str or v is None for v in distinct):
        return None
    try:
        encoded = [b"" if v is None else v.encode("utf-8") for v in distinct]
    except UnicodeEncodeError:
        return None
    codes = None
    if len(distinct) == 1:
        offsets = np.arange(n + 1, dtype=np.int64) * len(encoded[0])
    else:
        index = {v: i for i, v in enumerate(distinct)}
        codes = np.array(list(map(index.__getitem__, values)), dtype=np.intp)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.array([len(b) for b in encoded], dtype=np.int64)[codes], out=offsets[1:])
    if n and offsets[-1] > _MAX_STRING_BYTES:
        return None
    data = encoded[0] * n if codes is None else b"".join([encoded[c] for c in codes.tolist()])
    validity, nulls = None, 0
    if None in distinct:
        valid = codes != distinct.index(None) if codes is not None else np.zeros(n, dtype=bool)
        nulls = n - int(np.count_nonzero(valid))
        validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    buffers = [validity, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.string(), n, buffers, null_count=nulls)
