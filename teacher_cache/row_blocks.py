"""Row blocks of a shard regrouped into blocks of a chosen size, shared by the Zarr and Parquet
stores (``teacher_cache/store_zarr.py``, ``teacher_cache/store_parquet.py``).

A shard arrives as a stream of row blocks (``ShardStore.write_stream``: consecutive rows of every
N-axis array, cut anywhere); a store cuts and joins them into Zarr chunks / Parquet row groups of
a size of its own, so the bytes of a shard do not depend on how its rows arrived.
"""

from __future__ import annotations

import numpy as np

from teacher_cache.errors import CacheError


class RowBuffer:
    """Row blocks of one or more arrays in, blocks of a chosen number of rows out (copies only
    where a block is cut or blocks are joined)."""

    def __init__(self):
        self._blocks: list[dict[str, np.ndarray]] = []
        self.rows = 0

    def add(self, block: dict[str, np.ndarray]) -> None:
        rows = len(next(iter(block.values())))
        assert all(len(v) == rows for v in block.values()), "a row block's arrays differ in length"
        if rows:
            self._blocks.append(block)
            self.rows += rows

    def take(self, rows: int) -> dict[str, np.ndarray]:
        """The first ``rows`` rows held (at most ``self.rows``)."""
        parts = self.take_parts(rows)
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def take_parts(self, rows: int) -> list[dict[str, np.ndarray]]:
        """The first ``rows`` rows held (at most ``self.rows``), as consecutive blocks not yet joined."""
        assert 0 < rows <= self.rows, (rows, self.rows)
        parts, got = [], 0
        while got < rows:
            block = self._blocks[0]
            size = len(next(iter(block.values())))
            if got + size <= rows:
                parts.append(self._blocks.pop(0))
                got += size
            else:
                cut = rows - got
                parts.append({k: v[:cut] for k, v in block.items()})
                self._blocks[0] = {k: v[cut:] for k, v in block.items()}
                got = rows
        self.rows -= rows
        return parts


def check_row_count(rows: int, seq_offsets: np.ndarray) -> None:
    """The blocks written add up to the N = seq_offsets[-1] rows of the shard (CacheError otherwise)."""
    if rows != int(seq_offsets[-1]):
        raise CacheError(f"shard blocks hold {rows} rows, its sequence offsets {int(seq_offsets[-1])}")
