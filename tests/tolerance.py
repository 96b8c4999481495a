"""Equality within a tolerance, stated as a relative bound plus an absolute floor (not a test module).

A purely relative bound (``|x - y| <= r * max(|x|, |y|)``) fails on two values near zero that differ by
float noise: on one CPU the sum of a row's partial products comes out as +2e-9, on another as -1e-9, and
no relative step covers that. A purely absolute one hides a wrong result among large values. Every
comparison of two computations in the suite therefore uses ``|x - y| <= rel * max(|x|, |y|) + floor``,
with ``rel`` from the dtype the values are kept in and ``floor`` from the rounding error of the sums that
produced them, scaled by the magnitudes involved; each call says why next to it.
"""

from __future__ import annotations

import os

import torch

# Added to the seeds of the comparison tests (weights and data), so they can be run again on other numbers:
# AERIE_TEST_SEED=3 OMP_NUM_THREADS=1 python -m pytest ... (docs/testing.md, "Tolerances").
SEED = int(os.environ.get("AERIE_TEST_SEED", "0"))

FP32_EPS = 2.0**-23  # one fp32 unit in the last place, relative
BF16_STEP = 2.0**-7  # adjacent bf16 numbers differ by at most this fraction of their magnitude


def reduction_floor(scale: float, terms: int) -> float:
    """The absolute error two fp32 sums of ``terms`` products of size ``scale`` may differ by when they add
    in another order (another thread count, another rank split): at most ``terms * eps * scale`` each
    (the classic bound for recursive summation), so twice that between two of them."""
    return 2.0 * terms * FP32_EPS * scale


def assert_close(x: torch.Tensor, y: torch.Tensor, *, rel: float, floor: float, what: str = "") -> None:
    """``|x - y| <= rel * max(|x|, |y|) + floor`` everywhere; the message gives the worst element."""
    x, y = x.double(), y.double()
    assert x.shape == y.shape, f"{what}: shapes {tuple(x.shape)} and {tuple(y.shape)}"
    bound = rel * torch.maximum(x.abs(), y.abs()) + floor
    excess = (x - y).abs() - bound
    if (excess > 0).any():
        i = int(excess.argmax())
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {x.numel()} values differ by more than "
            f"{rel:.3g} relative + {floor:.3g} absolute; worst: {float(x.flatten()[i]):.6g} vs "
            f"{float(y.flatten()[i]):.6g} (excess {float(excess.max()):.3g})"
        )
