"""The release of this package (``pipeline.__version__``, HTTP ``/version``), a leaf that any
layer may read. Owns no state."""
from __future__ import annotations

__version__ = "0.1.0"  # as pyproject.toml's
