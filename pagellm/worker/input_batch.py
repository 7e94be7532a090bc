"""The persistent batch: per-request token and block-table rows kept across steps.

A request gets a row when first scheduled and keeps it until it finishes or is preempted; each step only
appends its new tokens and new blocks, so building the step's flat inputs is a few numpy gathers.
"""

from __future__ import annotations

import numpy as np


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int):
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def row(self, request_id: str) -> int:
        row = self.rows.get(request_id)
        if row is None:
            row = self.rows[request_id] = self.free_rows.pop()
            self.num_tokens[row] = 0
            self.num_blocks[row] = 0
        return row

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def sync(self, row: int, token_ids: list[int], block_ids: list[int]) -> None:
        """Append the tokens and blocks that are new since the last sync of this row."""
        have = int(self.num_tokens[row])
        if len(token_ids) > have:
            self.token_ids[row, have : len(token_ids)] = token_ids[have:]
            self.num_tokens[row] = len(token_ids)
        have_blocks = int(self.num_blocks[row])
        if len(block_ids) != have_blocks:
            self.block_table[row, : len(block_ids)] = block_ids
            self.num_blocks[row] = len(block_ids)
