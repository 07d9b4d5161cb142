"""Float64 exponentials and logarithms of the host's figures, through the C library.

numpy computes float64 exp and log with its own vector code where the CPU and its version have
one (AVX-512), and with the C library's elsewhere: the same fp32 scores came out a last bit
apart on two machines of one CPU class. Taken element by element from the C library, a figure's
bits depend on its scores alone, whatever the array around it or the numpy build."""

from __future__ import annotations

import math

import numpy as np


def exp(x: np.ndarray) -> np.ndarray:
    """e**x of a 1-D float array, as float64 (every exponent here is <= 0 or NaN)."""
    return np.fromiter(map(math.exp, x.tolist()), dtype=np.float64, count=len(x))


def log(x: np.ndarray) -> np.ndarray:
    """ln x of a 1-D float array, as float64 (every argument here is >= 1 or NaN)."""
    return np.fromiter(map(math.log, x.tolist()), dtype=np.float64, count=len(x))
