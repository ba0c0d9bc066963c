"""Left padding: prompts of different lengths as one static batch (chapter 07's `left_pad`).

>>> input_ids, attention_mask, position_ids = left_pad([[5, 6, 7], [8]])
>>> input_ids.tolist(), attention_mask.tolist(), position_ids.tolist()
([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
"""

from __future__ import annotations

import torch
from torch import Tensor


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Prompts of different lengths as one batch, padded on the left so that every row's last token is
    in the last column (where the next token is read and appended).

    -> input_ids, attention_mask (1 = real token, 0 = padding), position_ids (0, 1, … counting real tokens
    only; 0 on padding), each [B, longest] long.
    """
    longest = max(map(len, prompts))
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, longest - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, longest - len(ids) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids
