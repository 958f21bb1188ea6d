"""Zero-padding to whole blocks: a block format scales groups of ``block_size`` elements along
the last dimension, so a weight whose ``in_features`` is not a multiple of the block gets zero
columns (and its inputs zeros) before it is quantized."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .spec import Format


def pad_features(weight: Tensor, fmt: Format) -> Tensor:
    """``weight [out, in]`` with zero columns up to a multiple of the format's block."""
    block = fmt.block_size or 1
    extra = -weight.shape[1] % block
    return F.pad(weight, (0, extra)) if extra else weight
