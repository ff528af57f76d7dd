"""A Parquet file whose column chunks are encoded on parallel threads, byte for byte the file
pyarrow's own ``ParquetWriter`` writes.

pyarrow encodes and compresses the columns of a row group one after another on the calling
thread. A default shard is one row group whose rows must all have arrived before it is encoded, so
a build waited, after the teacher's last batch, for every column of its last shard in turn
(tests/benchmarks/RESULTS.md, "Teacher capture"). Here pyarrow writes each column of a row group,
with the same properties, as a one-column Parquet file in memory, each on its own thread (pyarrow
releases the GIL); their column chunks are then copied into the file in column order, and the
footer is pyarrow's footer of the whole schema (written for no rows) holding those column chunks'
metadata, moved to their offsets in the file. A column chunk's pages depend only on that column's
values and the writer properties, so the file is pyarrow's, byte for byte (tests/test_cache_store.py
compares the two for every codec and layout).

The footer is Thrift's compact protocol; ``_read_struct`` and ``_write_struct`` read and write it
generically (field ids and types, no Parquet schema), so the fields not touched here pass through.
"""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

_MAGIC = b"PAR1"

# Thrift compact protocol types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _STRUCT = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12
# Field ids of parquet.thrift: FileMetaData, RowGroup, ColumnChunk, ColumnMetaData
_FILE_NUM_ROWS, _FILE_ROW_GROUPS = 3, 4
_RG_COLUMNS, _RG_TOTAL_BYTES, _RG_FILE_OFFSET, _RG_COMPRESSED = 1, 2, 5, 6
_CC_FILE_OFFSET, _CC_META, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX = 2, 3, 4, 6
_CM_COMPRESSED, _CM_DATA_PAGE, _CM_INDEX_PAGE, _CM_DICT_PAGE, _CM_BLOOM = 7, 9, 10, 11, 14


class ParallelParquetWriter:
    """What ``pq.ParquetWriter(file, schema, **options)`` writes through ``write_table`` (one row
    group a call) and ``close``, with the columns of a row group encoded on up to ``threads``
    threads. file: a binary file open for writing, at its start."""

    def __init__(self, file, schema, options: dict, threads: int):
        self._file, self._schema, self._options = file, schema, options
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(threads, len(schema))),
                                        thread_name_prefix="parquet-column")
        self._offset, self._rows, self._row_groups = len(_MAGIC), 0, []
        file.write(_MAGIC)

    def write_row_group(self, make_columns: list) -> None:
        """One row group. make_columns: for each field of the schema, a function that returns the
        column's pyarrow array (called on the column's thread, so building it runs in parallel too)."""
        assert len(make_columns) == len(self._schema), (len(make_columns), len(self._schema))
        encoded = list(self._pool.map(self._encode_column, range(len(self._schema)), make_columns))
        columns = []
        for data, column_chunk, _ in encoded:
            columns.append(_moved(column_chunk, self._offset))
            self._file.write(data)
            self._offset += len(data)
        first_group = encoded[0][2]
        row_group = _replaced(first_group, {
            _RG_COLUMNS: (_STRUCT, columns),
            _RG_TOTAL_BYTES: sum(_field(group, _RG_TOTAL_BYTES) for _, _, group in encoded),
            _RG_FILE_OFFSET: _field(_field(columns[0], _CC_META), _CM_DICT_PAGE, None)
            or _field(_field(columns[0], _CC_META), _CM_DATA_PAGE),
            _RG_COMPRESSED: sum(_field(group, _RG_COMPRESSED) for _, _, group in encoded),
        })
        self._row_groups.append(row_group)
        self._rows += _field(first_group, 3)

    def _encode_column(self, index: int, make_column):
        """(column chunk bytes, its ColumnChunk metadata at offset 0, the one-column RowGroup)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([self._schema.field(index)])
        column = make_column()
        sink = pa.BufferOutputStream()
        with pq.ParquetWriter(sink, schema, **self._options) as writer:
            writer.write_table(pa.Table.from_arrays([column], schema=schema), row_group_size=max(1, len(column)))
        data = sink.getvalue()
        (row_group,) = _field(_footer(data), _FILE_ROW_GROUPS)[1]
        (column_chunk,) = _field(row_group, _RG_COLUMNS)[1]
        meta = _field(column_chunk, _CC_META)
        start = _field(meta, _CM_DICT_PAGE, None) or _field(meta, _CM_DATA_PAGE)
        return data[start:start + _field(meta, _CM_COMPRESSED)], _moved(column_chunk, -start), row_group

    def close(self) -> None:
        """Write the footer (the file stays open: the caller's)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pool.shutdown()
        sink = pa.BufferOutputStream()
        with pq.ParquetWriter(sink, self._schema, **self._options) as writer:
            writer.write_table(self._schema.empty_table())
        footer = _replaced(_footer(sink.getvalue()), {_FILE_NUM_ROWS: self._rows,
                                                      _FILE_ROW_GROUPS: (_STRUCT, self._row_groups)})
        out = bytearray()
        _write_struct(out, footer)
        self._file.write(bytes(out) + struct.pack("<I", len(out)) + _MAGIC)

    def abort(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def _footer(data) -> list:
    """The FileMetaData of the Parquet file ``data`` (bytes-like), as ``_read_struct`` returns it."""
    tail = memoryview(data)[-8:].tobytes()
    assert tail[4:] == _MAGIC, "not a Parquet file"
    size = struct.unpack("<I", tail[:4])[0]
    raw = memoryview(data)[-8 - size:-8].tobytes()
    footer, end = _read_struct(raw, 0)
    assert end == size, "the Parquet footer is longer than its stated size"
    return footer


def _moved(column_chunk: list, delta: int) -> list:
    """A ColumnChunk with every file offset in it moved by ``delta`` (0 means unset: kept)."""
    moved = {f: v + delta for f, _, v in column_chunk if f in (_CC_FILE_OFFSET, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX)
             and v}
    meta = _field(column_chunk, _CC_META)
    moved[_CC_META] = _replaced(meta, {f: v + delta for f, _, v in meta
                                       if f in (_CM_DATA_PAGE, _CM_INDEX_PAGE, _CM_DICT_PAGE, _CM_BLOOM)})
    return _replaced(column_chunk, moved)


_NO_DEFAULT = object()


def _field(fields: list, field_id: int, default=_NO_DEFAULT):
    for f, _, value in fields:
        if f == field_id:
            return value
    if default is _NO_DEFAULT:
        raise KeyError(f"Parquet footer field {field_id} missing")
    return default


def _replaced(fields: list, values: dict) -> list:
    """A struct with the values of the fields ``values`` names replaced (each must be there)."""
    missing = set(values) - {f for f, _, _ in fields}
    assert not missing, f"Parquet footer fields {sorted(missing)} missing"
    return [(f, t, values.get(f, v)) for f, t, v in fields]


# A struct is a list of (field id, type, value); a list value is (element type, [values]).

def _read_varint(data, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _read_value(data, i: int, kind: int):
    if kind in (_TRUE, _FALSE):  # a struct field's bool lives in its type
        return kind == _TRUE, i
    if kind == _BYTE:
        return data[i], i + 1
    if kind in (_I16, _I32, _I64):
        n, i = _read_varint(data, i)
        return (n >> 1) ^ -(n & 1), i
    if kind == _DOUBLE:
        return struct.unpack_from("<d", data, i)[0], i + 8
    if kind == _BINARY:
        n, i = _read_varint(data, i)
        return bytes(data[i:i + n]), i + n
    if kind in (_LIST, _SET):
        header = data[i]
        i += 1
        size, element = header >> 4, header & 0x0F
        if size == 15:
            size, i = _read_varint(data, i)
        items = []
        for _ in range(size):
            if element in (_TRUE, _FALSE):
                items.append(data[i] == _TRUE)
                i += 1
            else:
                value, i = _read_value(data, i, element)
                items.append(value)
        return (element, items), i
    if kind == _STRUCT:
        return _read_struct(data, i)
    raise ValueError(f"Thrift compact type {kind} is not used by Parquet footers")


def _read_struct(data, i: int) -> tuple[list, int]:
    fields, last = [], 0
    while True:
        header = data[i]
        i += 1
        if header == 0:
            return fields, i
        kind, delta = header & 0x0F, header >> 4
        if delta:
            field_id = last + delta
        else:
            n, i = _read_varint(data, i)
            field_id = (n >> 1) ^ -(n & 1)
        value, i = _read_value(data, i, kind)
        if kind in (_TRUE, _FALSE):
            kind = _TRUE
        fields.append((field_id, kind, value))
        last = field_id


def _write_varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63)


def _write_value(out: bytearray, kind: int, value) -> None:
    if kind == _BYTE:
        out.append(value & 0xFF)
    elif kind in (_I16, _I32, _I64):
        _write_varint(out, _zigzag(value))
    elif kind == _DOUBLE:
        out += struct.pack("<d", value)
    elif kind == _BINARY:
        _write_varint(out, len(value))
        out += value
    elif kind in (_LIST, _SET):
        element, items = value
        if len(items) < 15:
            out.append(len(items) << 4 | element)
        else:
            out.append(0xF0 | element)
            _write_varint(out, len(items))
        for item in items:
            if element in (_TRUE, _FALSE):
                out.append(_TRUE if item else _FALSE)
            else:
                _write_value(out, element, item)
    elif kind == _STRUCT:
        _write_struct(out, value)
    else:
        raise ValueError(f"Thrift compact type {kind} is not used by Parquet footers")


def _write_struct(out: bytearray, fields: list) -> None:
    last = 0
    for field_id, kind, value in fields:
        if kind in (_TRUE, _FALSE):
            kind = _TRUE if value else _FALSE
        if 0 < field_id - last <= 15:
            out.append((field_id - last) << 4 | kind)
        else:
            out.append(kind)
            _write_varint(out, _zigzag(field_id))
        if kind not in (_TRUE, _FALSE):
            _write_value(out, kind, value)
        last = field_id
    out.append(0)
