"""Parquet shard store: one file per shard, one row per position.

Layout: 1-D arrays are plain columns; [N, k] arrays are non-nullable FixedSizeList<k> columns, so
a row holds a position's whole top-k and the ids stay next to each other on disk.
``seq_offsets`` ([S + 1], not N rows) and the exact numpy dtype and trailing shape of every array
live in the schema's key-value metadata under ``distill.shard``, as JSON
``{"seq_offsets": [...], "arrays": {name: {"dtype", "shape"}}}``; pyarrow alone reads it with
``pq.read_schema(path).metadata[b"distill.shard"]``. float16 is stored as its uint16 bits so any
Parquet reader gets exact values back.

FixedSizeList columns with BYTE_STREAM_SPLIT and zstd were chosen because on top-k data they came
out smaller than plain encodings and than one column per rank, and as small as the Zarr store.

Rows go to disk as they arrive, in row groups of a fixed number of rows (``row_group_bytes`` of
stored values, at most 2^20 rows, the size pyarrow picks for a whole table): a long sequence spans
several row groups and a writer holds one at a time; a shard that fits in one (the default
corpus's) is laid out as a single ``pq.write_table`` of it would be.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from distill.files import atomic_file
from teacher_cache.row_blocks import RowBuffer, check_row_count

_META_KEY = b"distill.shard"
# Level 3 compresses top-k data nearly as well as level 9 and writes much faster.
_ZSTD_LEVEL = 3
# Large enough that a row group compresses as well as a whole shard (zstd works per page), small
# enough that a writer thread holds little of a million-token sequence at once.
ROW_GROUP_BYTES = 128 << 20
_MAX_ROW_GROUP_ROWS = 1 << 20
# One thread per column: a shard has at most about eight, and their encoding is the work a build
# waits for after the teacher's last batch (tests/benchmarks/RESULTS.md, "Teacher capture").
_COLUMN_THREADS = 8
_WRITE_OPTIONS = {"compression": "zstd", "compression_level": _ZSTD_LEVEL, "use_dictionary": False,
                  "use_byte_stream_split": True, "write_statistics": False, "write_page_checksum": True}


class ParquetStore:
    """row_group_bytes: stored bytes of the rows of one row group (rows of all columns); threads:
    columns of a row group encoded at once (teacher_cache/parquet_columns.py; the bytes do not
    depend on it)."""

    format = "parquet"
    suffix = ".parquet"
    root_file = None

    def __init__(self, row_group_bytes: int = ROW_GROUP_BYTES, threads: int = _COLUMN_THREADS):
        self.row_group_bytes, self.threads = row_group_bytes, threads

    def codecs(self) -> dict:
        return {"compression": f"zstd(level={_ZSTD_LEVEL})", "encoding": "BYTE_STREAM_SPLIT, no dictionary",
                "layout": "one row per position; [N, k] arrays as FixedSizeList<k>", "checksum": "page crc32"}

    def write(self, path: Path, arrays: dict[str, np.ndarray]) -> None:
        rows = {name: value for name, value in arrays.items() if name != "seq_offsets"}
        self.write_stream(path, arrays["seq_offsets"], [rows])

    def write_stream(self, path: Path, seq_offsets: np.ndarray, blocks) -> None:
        from teacher_cache.parquet_columns import ParallelParquetWriter

        buffer, writer, group_rows, written = RowBuffer(), None, 0, 0
        with atomic_file(path) as f:
            try:
                for block in blocks:
                    buffer.add(block)
                    if writer is None:
                        schema = _schema(block, seq_offsets)
                        writer = ParallelParquetWriter(f, schema, _WRITE_OPTIONS, self.threads)
                        group_rows = self._group_rows(block)
                    while buffer.rows >= group_rows:
                        written += self._write_group(writer, schema, buffer.take_parts(group_rows))
                if buffer.rows:
                    written += self._write_group(writer, schema, buffer.take_parts(buffer.rows))
                check_row_count(written, seq_offsets)
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
            writer.close()

    def _group_rows(self, block: dict[str, np.ndarray]) -> int:
        row_bytes = sum(v.itemsize * int(np.prod(v.shape[1:], dtype=np.int64)) for v in block.values())
        return max(1, min(_MAX_ROW_GROUP_ROWS, self.row_group_bytes // max(1, row_bytes)))

    @staticmethod
    def _write_group(writer, schema, parts: list[dict[str, np.ndarray]]) -> int:
        """parts: consecutive row blocks, joined per column on that column's thread."""
        def column(name):
            return lambda: _column(parts[0][name] if len(parts) == 1 else np.concatenate([p[name] for p in parts]))

        writer.write_row_group([column(field.name) for field in schema])
        return sum(len(p["input_ids"]) for p in parts)

    @staticmethod
    def _meta(schema) -> dict:
        return json.loads(schema.metadata[_META_KEY])

    def read(self, path: Path) -> dict[str, np.ndarray]:
        import pyarrow.parquet as pq

        source, filesystem = _source(path)
        table = pq.read_table(source, filesystem=filesystem, page_checksum_verification=True)
        meta = self._meta(table.schema)
        out = {"seq_offsets": np.asarray(meta["seq_offsets"], dtype=np.int64)}
        for name, info in meta["arrays"].items():
            column = table.column(name).combine_chunks()
            flat = column.flatten() if info["shape"] else column
            values = flat.to_numpy(zero_copy_only=False)
            dtype = np.dtype(info["dtype"])
            if dtype == np.float16:
                values = values.view(np.float16)
            out[name] = values.astype(dtype, copy=False).reshape(len(column), *info["shape"])
        return out

    def read_offsets(self, path: Path) -> np.ndarray:
        import pyarrow.parquet as pq

        source, filesystem = _source(path)
        return np.asarray(self._meta(pq.read_schema(source, filesystem=filesystem))["seq_offsets"], dtype=np.int64)


def _source(path) -> tuple[str, object]:
    """(path, filesystem) for pyarrow: a local file, or an object through pyarrow's fsspec support."""
    fs = getattr(path, "fs", None)  # a teacher_cache.location.RemotePath
    return (path.path, fs) if fs is not None else (str(path), None)


def _column(value: np.ndarray):
    """A 1-D array as a plain column, [n, ...] as FixedSizeList<prod(...)>; float16 as its bits."""
    import pyarrow as pa

    stored = value.view(np.uint16) if value.dtype == np.float16 else value
    flat = pa.array(stored.reshape(-1))
    if value.ndim == 1:
        return flat
    width = int(np.prod(value.shape[1:], dtype=np.int64))
    return pa.FixedSizeListArray.from_arrays(flat, type=pa.list_(pa.field("item", flat.type, nullable=False), width))


def _schema(block: dict[str, np.ndarray], seq_offsets: np.ndarray):
    """The shard's schema from its first row block; ``seq_offsets`` and the arrays' numpy dtypes
    and trailing shapes in its metadata."""
    import pyarrow as pa

    fields, described = [], {}
    for name, value in block.items():
        described[name] = {"dtype": value.dtype.str, "shape": list(value.shape[1:])}
        fields.append(pa.field(name, _column(value[:0]).type, nullable=False))
    meta = {"seq_offsets": np.asarray(seq_offsets).tolist(), "arrays": described}
    return pa.schema(fields, metadata={_META_KEY: json.dumps(meta).encode()})
