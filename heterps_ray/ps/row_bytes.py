"""What a sparse-table row costs in memory, in each tier: the CPU store (ps/_rows.c, ps/table.py) and the
GPU tier (ps/device_table.py, ps/device_index.py). The planner sizes tables with these (costmodel/
table_memory.py, scheduling/gpu_cloud.py), the tiers hold themselves to them."""

from __future__ import annotations

# B/row of the index at its sparsest (load 3/8, just after doubling): a uint32 row number and a uint8 tag
# per slot (_rows.c). 136 B of payload + 13.3 = 149.3 B/row is what 10M fresh dim-16 keys measured.
INDEX_BYTES = (4 + 1) / 0.375
CANDIDATE_BYTES = 16  # key, count, last seen of a key waiting for admission

def row_bytes(dim: int, optimizer: str = "adagrad", tracked: bool = False) -> int:
    """Bytes of one stored row: key, weights, optimizer state (and 8 B of counters when tracked)."""
    return 8 + 4 * dim + 4 * (1 if optimizer == "rowwise_adagrad" else dim) + (8 if tracked else 0)


def stored_bytes_per_row(dim: int, optimizer: str = "adagrad", tracked: bool = False) -> float:
    """Memory one row takes in the store at its worst: the row and its share of the index at its sparsest."""
    return row_bytes(dim, optimizer, tracked) + INDEX_BYTES


# a bucket of the GPU tier's key index (ps/device_index.py): an int64 key, an int32 slot, an int32 claim;
# the index keeps its load at most 1/2, so two buckets a row
DEVICE_INDEX_BUCKET_BYTES = 8 + 4 + 4


def device_row_bytes(dim: int, optimizer: str = "adagrad") -> int:
    """GPU bytes of one row the GPU tier holds (ps/device_table.py): weights, optimizer state, per slot
    a dirty and a held flag, the batch it was last used in and its key (int64 each), the batches in
    flight that pin it (int32), and two buckets of the key index."""
    state = 4 * (1 if optimizer == "rowwise_adagrad" else dim)
    return 4 * dim + state + 1 + 1 + 8 + 8 + 4 + 2 * DEVICE_INDEX_BUCKET_BYTES


def device_rows_within(budget_bytes: float, dim: int, optimizer: str = "adagrad") -> int:
    """Rows the GPU tier may hold within `budget_bytes` of device memory: its slots double as it fills,
    so at the last doubling the old half and the new whole are both alive (1.5x the rows' bytes)."""
    return max(0, int(budget_bytes // (1.5 * device_row_bytes(dim, optimizer))))


def max_rows_for(memory_bytes: float, dim: int, optimizer: str = "adagrad", admit_after: int = 1) -> int:
    """The row cap (``max_rows``) that keeps one table within `memory_bytes` at its worst: rows with
    counters, the index at its sparsest, and as many keys waiting for admission as rows."""
    per_row = stored_bytes_per_row(dim, optimizer, tracked=True)
    if admit_after > 1:
        per_row += CANDIDATE_BYTES + INDEX_BYTES
    return max(1, int(memory_bytes // per_row))
