"""What ``kbbq-pl serve`` gives transformers' server, which loads the model in a process of
its own (spawned: it imports nothing of its parent but what it unpickles).

:class:`KbbqServe` is transformers' ``Serve`` whose model loader is a :class:`KbbqModelLoader`:
unpickled in the model's process, it imports this module, so kbbq-pl, whose import registers
the ``kbbq`` quantization method (without it transformers read a kbbq-pl folder as an unknown
method: random weights, refused for their sizes), and on the CPU it keeps the decoded weights
for the process's life (:func:`kbbq_pl.quant.w4a4.cache_decoded_weights`).  Imported only to
serve: transformers' server needs the ``serve`` extra.
"""

from __future__ import annotations

import contextlib
from typing import Any

from transformers.cli.serve import Serve
from transformers.cli.serving.model_manager import ModelLoader
from transformers.utils import logging as hf_logging

from ..quant.w4a4 import cache_decoded_weights


class KbbqModelLoader(ModelLoader):
    """transformers' ``ModelLoader``, loading in a process where kbbq-pl is imported;
    ``cache_weights``: keep each quantized weight's decoded copy there (the CPU's emulation)."""

    cache_weights = False

    def load_model_and_processor(self, model_id: str, on_progress: Any = None) -> Any:
        # no "Loading weights" bar: tqdm's first bar makes a semaphore, which the process,
        # stopped by its server without cleanup, would leave behind (a warning at exit)
        hf_logging.disable_progress_bar()
        if self.cache_weights:  # held until the model's process ends
            self._cache = contextlib.ExitStack()
            self._cache.enter_context(cache_decoded_weights())
        return super().load_model_and_processor(model_id, on_progress=on_progress)


class KbbqServe(Serve):
    """transformers' ``Serve`` (its arguments), its model loaded by a :class:`KbbqModelLoader`
    (``cache_weights``)."""

    def __init__(self, *args: Any, cache_weights: bool = False, **kwargs: Any) -> None:
        self._cache_weights = cache_weights
        super().__init__(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> None:
        # Serve.__init__ builds its loader, then runs: the loader becomes kbbq-pl's here
        self.loader.__class__ = KbbqModelLoader
        self.loader.cache_weights = self._cache_weights
        super().run(*args, **kwargs)
