"""Room to add: the power of two that keeps sums of large finite values below float64's maximum.

Both engines take any finite, non-negative value (up to 1.8e308) and form sums and means of
them, which would overflow to infinity (and then NaN) near the top of the range. Every score
they derive is a ratio, unchanged when all its inputs are divided by the same number; dividing
by a power of two is exact (values below about 1e-300 of the largest round towards zero, far
below any threshold). So a rule divides its inputs by ``2**headroom_shift(values)`` before it
sums, and multiplies absolute results (milliseconds, cycles) back.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["HEADROOM_EXPONENT", "headroom_shift"]

# Values are scaled below 2**1000, which leaves room for sums of up to 2**23 of them.
HEADROOM_EXPONENT = 1000


def headroom_shift(values: np.ndarray) -> int:
    """``k >= 0`` such that ``values / 2**k`` all lie below ``2**HEADROOM_EXPONENT`` (0 for the
    values any real job has; ``values`` finite and non-negative)."""
    top = float(np.max(values)) if np.size(values) else 0.0
    return max(0, math.frexp(top)[1] - HEADROOM_EXPONENT)
