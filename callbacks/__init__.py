"""Lightning callbacks of kbbq-pl, installed as ``kbbq_pl.callbacks``."""

from .kbbq import KBBQ, CalibrationStatistics, calibration_batches, restore_quantized

__all__ = ["KBBQ", "CalibrationStatistics", "calibration_batches", "restore_quantized"]
