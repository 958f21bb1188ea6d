"""The version of kbbq-pl (one place; the package and the output markers read it)."""

__version__ = "0.1.0"
