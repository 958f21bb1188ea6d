"""One process or many: ``kbbq-pl quantize`` under ``torchrun``.

``torchrun --nproc_per_node N $(which kbbq-pl) quantize ...`` starts N copies of the command
(several nodes: torchrun's rendezvous options); each finds ``RANK``, ``LOCAL_RANK`` and
``WORLD_SIZE`` in its environment.  :func:`launched` then initializes the default process group
(NCCL for CUDA, one GPU per local rank; gloo for the CPU), and the command calibrates each rank on
its share of the calibration batches, sums the statistics over the group
(:func:`~kbbq_pl.quant.config.torch_distributed_collectives`), splits GPTQ's layers across the
ranks, and rank 0 alone writes.  Without torchrun it is one process, as before.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..io.models import parse_device


@dataclass
class Launch:
    """This process's place: its ``rank`` of ``world_size``, the ``device`` it computes on and
    the keyword arguments of :func:`~kbbq_pl.quant.pipeline.quantize_model` for the group (none
    on one process): its collectives, and ``shard`` (every rank builds the whole calibration set
    and calibrates on its share of it)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    collectives: dict[str, Any] = field(default_factory=dict)

    @property
    def writes(self) -> bool:
        """Whether this process writes the output (rank 0)."""
        return self.rank == 0


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    # torchrun stops the other processes when one fails: unwind as on Ctrl-C (the staging
    # folder of rank 0 is removed, and the command says "interrupted" in one line)
    raise KeyboardInterrupt


@contextlib.contextmanager
def launched(device: str, timeout_minutes: float = 30.0) -> Iterator[Launch]:
    """This process's :class:`Launch`: under torchrun (``WORLD_SIZE`` > 1) the default process
    group is initialized for the duration (``timeout_minutes`` for a collective to complete:
    a rank that dies stops the others then, or sooner when torchrun stops them) and SIGTERM
    unwinds like an error, so that nothing half-written is left; ``--device cuda`` becomes
    ``cuda:LOCAL_RANK``."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        yield Launch(device=parse_device(device))
        return
    import torch.distributed as dist

    from ..quant.config import torch_distributed_collectives

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    parsed = parse_device(device)
    if parsed.type == "cuda":
        parsed = parse_device(f"cuda:{local_rank}")
        torch.cuda.set_device(parsed)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    dist.init_process_group("nccl" if parsed.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    try:
        yield Launch(rank, world_size, parsed, {**torch_distributed_collectives(), "shard": True})
    finally:
        dist.destroy_process_group()
        signal.signal(signal.SIGTERM, previous)
