"""Turn a StepPlan into the flat token batch and attention metadata the model reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raygraph.model.context import AttentionMetadata, ForwardContext
from raygraph.protocol import StepPlan


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    ctx: ForwardContext
    sample_idx: torch.Tensor  # [S]: rows of the hidden states whose logits are sampled

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def prepare_batch(plan: StepPlan, block_size: int, device: torch.device) -> Batch:
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    token_seq: list[int] = []
    token_row: list[int] = []
    seq_lens: list[int] = []
    sample_idx: list[int] = []
    max_blocks = max(len(s.block_table) for s in plan.seqs)
    tables = []
    for b, s in enumerate(plan.seqs):
        n = len(s.token_ids)
        end = s.start_pos + n
        if len(s.block_table) * block_size < end:
            raise ValueError(f"seq {s.seq_id}: {len(s.block_table)} blocks cannot hold {end} tokens")
        ids += s.token_ids
        pos += range(s.start_pos, end)
        slots += (s.block_table[p // block_size] * block_size + p % block_size
                  for p in range(s.start_pos, end))
        token_seq += [b] * n
        token_row += range(n)
        seq_lens.append(end)
        tables.append(s.block_table + [0] * (max_blocks - len(s.block_table)))
        if s.sample:
            sample_idx.append(len(ids) - 1)

    def t(x: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    positions = t(pos)
    md = AttentionMetadata(
        slot_mapping=t(slots),
        block_tables=t(tables, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        positions=positions,
        token_seq=t(token_seq),
        token_row=t(token_row),
        max_q_len=max(len(s.token_ids) for s in plan.seqs),
        max_kv_len=max(seq_lens),
    )
    return Batch(t(ids), positions, ForwardContext(attn=md), t(sample_idx))
