"""rankwatch: find the slow rank in distributed PyTorch training.

The work lives in two subpackages: :mod:`rankwatch.diagnosis` (the pure-numpy engines) and
:mod:`rankwatch.exporter` (collectors, publishers, the command line). This package only names
the version; importing it imports neither torch nor OpenTelemetry.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
