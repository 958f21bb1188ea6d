"""Everything that reads or writes: atomic output folders (:mod:`~kbbq_pl.io.fileio`), kbbq-pl
checkpoints (:mod:`~kbbq_pl.io.checkpoint`), compressed-tensors folders
(:mod:`~kbbq_pl.io.compressed_tensors`), loading models (:mod:`~kbbq_pl.io.models`), calibration
data (:mod:`~kbbq_pl.io.data`) and llama2.c checkpoints (:mod:`~kbbq_pl.io.llama2c`)."""
