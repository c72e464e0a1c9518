"""The ``mla`` command line and the walkthrough it runs (``mla walkthrough``)."""

from mla.cli.main import main

__all__ = ["main"]
