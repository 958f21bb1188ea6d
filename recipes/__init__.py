"""Packaged YAML recipes (``kbbq_pl.recipes``)."""
