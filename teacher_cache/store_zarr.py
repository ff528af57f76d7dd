"""Zarr v3 shard store: one group directory per shard, one array per shard array, including
``seq_offsets`` int64 [S + 1] (so zarr alone opens every array of a shard by name).

Compression: Blosc with zstd and byte shuffle beats plain zstd on int32 ids and float log-probs,
because the high bytes of ids below 2^16 and the sign/exponent bytes of sorted log-probs are
nearly constant; it matches a separate shuffle filter + zstd, and unlike that filter it is in the Zarr v3 spec, so other Zarr implementations can read
the shards. A crc32c codec per chunk lets a read detect a damaged chunk even without the
manifest checksum.

Rows go to disk as they arrive, each array's chunks written whole once (a sequence longer than a
chunk spans several), so a writer holds about one chunk per array at a time.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from distill.files import atomic_dir
from teacher_cache.errors import CacheError
from teacher_cache.row_blocks import RowBuffer, check_row_count

# Several chunks per array let Zarr compress them on parallel threads, bound the memory of a
# write and stay far below Blosc's 2 GiB buffer limit; smaller chunks did not compress worse.
CHUNK_BYTES = 8 << 20
_BLOSC_LEVEL = 5


class ZarrStore:
    """chunk_bytes: the most bytes of one chunk of an array (before compression)."""

    format = "zarr"
    suffix = ".zarr"
    root_file = "zarr.json"  # the group's metadata

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes

    def codecs(self) -> dict:
        return {"compressor": f"blosc(zstd, clevel={_BLOSC_LEVEL}, shuffle=byte)", "checksum": "crc32c per chunk",
                "chunk_bytes_max": self.chunk_bytes}

    def _compressors(self):
        from zarr.codecs import BloscCodec, Crc32cCodec

        return [BloscCodec(cname="zstd", clevel=_BLOSC_LEVEL, shuffle="shuffle"), Crc32cCodec()]

    def write(self, path: Path, arrays: dict[str, np.ndarray]) -> None:
        rows = {name: value for name, value in arrays.items() if name != "seq_offsets"}
        self.write_stream(path, arrays["seq_offsets"], [rows])

    def write_stream(self, path: Path, seq_offsets: np.ndarray, blocks) -> None:
        import zarr

        num_rows = int(seq_offsets[-1])
        with atomic_dir(path) as tmp:
            group = zarr.create_group(store=str(tmp), zarr_format=3)
            columns: dict[str, _Column] = {}
            for block in blocks:
                if not columns:
                    for name, value in block.items():
                        columns[name] = _Column(self._create(group, name, (num_rows, *value.shape[1:]), value.dtype))
                        if name == "input_ids":  # where the original layout has seq_offsets
                            self._create(group, "seq_offsets", seq_offsets.shape, seq_offsets.dtype)[...] = seq_offsets
                for name, column in columns.items():
                    column.add(block[name])
            for column in columns.values():
                column.flush()
            check_row_count(min((c.written for c in columns.values()), default=0), seq_offsets)
            _fsync_files(tmp)

    def _create(self, group, name: str, shape: tuple, dtype):
        row_bytes = max(1, np.dtype(dtype).itemsize * int(np.prod(shape[1:], dtype=np.int64)))
        rows = max(1, min(shape[0], self.chunk_bytes // row_bytes))
        return group.create_array(
            name,
            shape=shape,
            dtype=dtype,
            chunks=(rows, *shape[1:]),
            compressors=self._compressors(),
            fill_value=0,
            # every chunk gets a file, so a deleted chunk file is a missing file, not silent zeros
            config={"write_empty_chunks": True},
        )

    def read(self, path: Path) -> dict[str, np.ndarray]:
        import zarr

        group = zarr.open_group(store=str(path), mode="r", zarr_format=3)
        return {name: np.asarray(array[...]) for name, array in group.arrays()}

    def read_offsets(self, path: Path) -> np.ndarray:
        import zarr

        return np.asarray(zarr.open_array(store=str(path), path="seq_offsets", mode="r", zarr_format=3)[...])


class _Column:
    """One array of a shard being written: rows buffered until a whole chunk can be written."""

    def __init__(self, array):
        self.array, self.buffer, self.written = array, RowBuffer(), 0
        self.chunk_rows = array.chunks[0]

    def add(self, rows: np.ndarray) -> None:
        if self.written + self.buffer.rows + len(rows) > self.array.shape[0]:
            raise CacheError(f"shard array {self.array.basename} gets more rows than its {self.array.shape[0]}")
        self.buffer.add({"rows": rows})
        while self.buffer.rows >= self.chunk_rows:
            self._write(self.buffer.take(self.chunk_rows)["rows"])

    def flush(self) -> None:
        if self.buffer.rows:
            self._write(self.buffer.take(self.buffer.rows)["rows"])

    def _write(self, rows: np.ndarray) -> None:
        self.array[self.written : self.written + len(rows)] = rows
        self.written += len(rows)


def _fsync_files(folder: Path) -> None:
    """Flush every file under ``folder`` to disk, so the rename that follows publishes whole files."""
    for root, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
