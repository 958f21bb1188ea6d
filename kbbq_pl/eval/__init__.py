"""Measuring quantized models: fidelity, perplexity and sentence embeddings
(:mod:`~kbbq_pl.eval.evaluation`, accumulated in the torchmetrics metrics of
:mod:`~kbbq_pl.eval.metrics`), lm-eval tasks (:mod:`~kbbq_pl.eval.tasks`), the noise
law per GEMM cell and its report (:mod:`~kbbq_pl.eval.law_cells`,
:mod:`~kbbq_pl.eval.law_report`) and the quantization report's files, ``report.json`` and
``report.md`` (:mod:`~kbbq_pl.eval.report_files`)."""
