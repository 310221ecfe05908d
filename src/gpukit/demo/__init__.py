"""gpukit's built-in example: a small CNN on scikit-learn's 8x8 handwritten digits.

The data set ships inside scikit-learn (no download at run time). ``gpukit demo`` trains it
with a :class:`gpukit.Session` on the automatically chosen devices, then saves a checkpoint
and reloads it into a plain, unwrapped model to show that the result is portable.
"""

from __future__ import annotations

from gpukit.demo._data import load_digits_split
from gpukit.demo._job import DemoConfig, DemoResult, run_demo, train_worker
from gpukit.demo._model import DigitsCNN

__all__ = ["DemoConfig", "DemoResult", "DigitsCNN", "load_digits_split", "run_demo", "train_worker"]
