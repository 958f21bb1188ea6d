"""Lightning callbacks of kbbq-pl, installed as ``kbbq_pl.callbacks``."""
