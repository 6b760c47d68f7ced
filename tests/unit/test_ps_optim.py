"""The servers' SGD step (rdmamw/ps/optim.py, rdmamw/ps/_sgd.pyx): the fused Cython
loop and the numpy path agree with a float64 reference, with and without delay
compensation; compensation leaves a gradient computed on the current model alone."""

from __future__ import annotations

import numpy as np
import pytest

from rdmamw.ps.optim import PIECE, SGD


def reference(w, v, g, scale, lr, mu, dc=0.0, bak=None):
    w, v, g = (a.astype(np.float64) for a in (w, v, g))
    if dc and bak is not None:
        g = g + dc * g * g * (w - bak.astype(np.float64))
    v = mu * v + scale * g
    return w - lr * v, v


def arrays(n, dt, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dt) for _ in range(4)]


@pytest.mark.parametrize("dt", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("n", [0, 1, 7, PIECE + 3])
@pytest.mark.parametrize("dc, pulled", [(0.0, True), (0.5, True), (0.5, False)])
def test_step_matches_the_reference(dt, n, dc, pulled):
    """(No pulled copy yet: a gradient pushed before the first pull, not compensated.)"""
    w, v, g, bak = arrays(n, dt)
    bak = bak if pulled else None
    rw, rv = reference(w, v, g, 0.25, 0.1, 0.9, dc, bak)
    SGD(0.1, 0.9, dc).step(w, v, g, 0.25, bak)
    tol = 2e-2 if dt == np.float16 else 1e-5
    assert np.allclose(w, rw, rtol=tol, atol=tol) and np.allclose(v, rv, rtol=tol, atol=tol)


@pytest.mark.parametrize("dt", [np.float32, np.float16])
def test_a_step_scales_by_one_and_compensates_nothing_unless_told(dt):
    w, v, g, bak = arrays(7, dt)
    rw, rv = reference(w, v, g, 1.0, 0.1, 0.9)
    SGD(0.1, 0.9).step(w, v, g, bak=bak)
    tol = 2e-2 if dt == np.float16 else 1e-5
    assert np.allclose(w, rw, rtol=tol, atol=tol) and np.allclose(v, rv, rtol=tol, atol=tol)


@pytest.mark.parametrize("dt", [np.float32, np.float16])
@pytest.mark.parametrize("dc", [0.25, 2.0])       # a lambda below 1 too (hybrid's is 0.04)
@pytest.mark.parametrize("n", [1000, PIECE + 3])  # one piece, and a second one
def test_compensation_is_nothing_for_a_fresh_gradient_and_the_formula_otherwise(dt, dc, n):
    w, v, g, _ = arrays(n, dt, seed=1)
    acc_plain, acc_dc, acc_far = (np.zeros(n, dt) for _ in range(3))
    SGD(0.1, 0.9).accumulate(acc_plain, g, w)
    SGD(0.1, 0.9, dc=dc).accumulate(acc_dc, g, w, bak=w.copy())      # pulled == now
    assert np.array_equal(acc_plain, acc_dc)
    acc_dc.fill(0)
    SGD(0.1, 0.9, dc=dc).accumulate(acc_dc, g, w)        # no pulled copy yet: plain
    assert np.array_equal(acc_plain, acc_dc)
    bak = (w - 0.5).astype(dt)
    acc_far += 1                        # it adds to what the round holds already
    SGD(0.1, 0.9, dc=dc).accumulate(acc_far, g, w, bak)
    g64 = g.astype(np.float64)
    expect = 1 + g64 + dc * g64 * g64 * (w.astype(np.float64) - bak)
    assert np.allclose(acc_far, expect, rtol=1e-2 if dt == np.float16 else 1e-5, atol=1e-3)


def test_bad_sizes_and_lambda_are_refused():
    w, v, g, bak = arrays(10, np.float32)
    with pytest.raises(ValueError, match="velocity"):
        SGD(0.1, 0.9).step(w, v[:5], g)
    with pytest.raises(ValueError, match="pulled copy"):
        SGD(0.1, 0.9, dc=1.0).step(w, v, g, 1.0, bak[:3])
    with pytest.raises(ValueError, match=">= 0"):
        SGD(0.1, 0.9, dc=-1.0)
