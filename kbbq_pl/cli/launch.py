"""One process or many: ``kbbq-pl quantize`` under ``torchrun``.

``torchrun --nproc_per_node N $(which kbbq-pl) quantize ...`` starts N copies of the command
(several nodes: torchrun's rendezvous options); each finds ``RANK``, ``LOCAL_RANK`` and
``WORLD_SIZE`` in its environment.  :func:`launched` then initializes the default process group
(NCCL for CUDA, one GPU per local rank; gloo for the CPU), and the command calibrates each rank on
its share of the calibration batches, sums the statistics over the group
(:meth:`~kbbq_pl.quant.collectives.Collectives.torch_distributed`), splits GPTQ's layers across the
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
from ..quant.collectives import Collectives


@dataclass
class Launch:
    """This process's place: the ``device`` it computes on, the group's ``collectives`` and
    ``shard``, as :func:`~kbbq_pl.quant.pipeline.quantize_model` takes them (one process: the
    identities; under torchrun every rank builds the whole calibration set and calibrates on its
    share of it)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    collectives: Collectives = field(default_factory=Collectives)
    shard: bool = False

    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def world_size(self) -> int:
        return self.collectives.world_size

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

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    parsed = parse_device(device)
    if parsed.type == "cuda":
        parsed = parse_device(f"cuda:{local_rank}")
        torch.cuda.set_device(parsed)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    dist.init_process_group("nccl" if parsed.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    try:
        yield Launch(parsed, Collectives.torch_distributed(), shard=True)
    finally:
        dist.destroy_process_group()
        signal.signal(signal.SIGTERM, previous)
