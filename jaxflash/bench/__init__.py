"""Benchmark: ``python -m jaxflash.bench`` (see ``__main__.py``)."""
