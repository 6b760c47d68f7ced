"""The servers' optimizer: SGD with momentum, in place. float32 / float64 go through
one fused Cython loop (rdmamw/ps/_sgd.pyx, GIL released); other dtypes through numpy
a cache-sized piece at a time. Neither allocates a model-sized temporary (a 4 MiB
temporary costs a thousand page faults per step).

Optional delay compensation (DC-ASGD, Zheng et al. 2017): a gradient ``g`` computed
on the model ``w_bak`` the worker pulled, applied when the model is ``w``, is first
corrected by the first-order Taylor term with the diagonal outer-product
approximation of the Hessian: ``g + dc * g * g * (w - w_bak)``. With ``w == w_bak``
(a fresh gradient) it changes nothing."""

from __future__ import annotations

import numpy as np

from rdmamw.ps import _sgd

FUSED = (np.dtype(np.float32), np.dtype(np.float64))
PIECE = 1 << 16          # elements per piece: 256 KiB of float32, fits L2


class SGD:
    """``v = momentum * v + scale * g'``; ``w -= lr * v``, with ``g'`` the
    delay-compensated gradient when ``dc > 0`` and the worker's pulled copy is given."""

    def __init__(self, lr: float, momentum: float, dc: float = 0.0) -> None:
        if dc < 0:
            raise ValueError(f"delay compensation must be >= 0, not {dc}")
        self.lr, self.momentum, self.dc = lr, momentum, dc
        self._scratch: dict[np.dtype, np.ndarray] = {}

    def _tmp(self, dt: np.dtype, n: int) -> np.ndarray:
        t = self._scratch.get(dt)
        if t is None or t.size < n:
            t = self._scratch[dt] = np.empty(max(n, PIECE), dt)
        return t[:n]

    def _grad(self, g: np.ndarray, w: np.ndarray, bak: np.ndarray | None,
              scale: float, out: np.ndarray) -> np.ndarray:
        """``out = scale * g'`` for one piece."""
        if self.dc > 0 and bak is not None:
            np.subtract(w, bak, out=out)
            out *= g
            out *= g
            out *= self.dc
            out += g
            out *= scale
        else:
            np.multiply(g, scale, out=out)
        return out

    def step(self, w: np.ndarray, v: np.ndarray, g: np.ndarray, scale: float = 1.0,
             bak: np.ndarray | None = None) -> None:
        """One update of the flat arrays ``w`` and ``v`` (same length as ``g``)."""
        if g.dtype in FUSED and w.dtype == g.dtype:
            _sgd.step(w, v, g, scale, self.lr, self.momentum, self.dc, bak)
            return
        for o in range(0, g.size, PIECE):
            e = min(o + PIECE, g.size)
            wp, vp = w[o:e], v[o:e]
            t = self._grad(g[o:e], wp, None if bak is None else bak[o:e], scale,
                           self._tmp(g.dtype, e - o))
            vp *= self.momentum
            vp += t
            np.multiply(vp, self.lr, out=t)
            wp -= t

    def accumulate(self, acc: np.ndarray, g: np.ndarray, w: np.ndarray,
                   bak: np.ndarray | None = None) -> None:
        """``acc += g'`` (a round's sum), compensated against the current ``w``."""
        if g.dtype in FUSED and w.dtype == g.dtype:
            _sgd.accumulate(acc, g, w, self.dc, bak)
            return
        if self.dc <= 0 or bak is None:
            acc += g
            return
        for o in range(0, g.size, PIECE):
            e = min(o + PIECE, g.size)
            acc[o:e] += self._grad(g[o:e], w[o:e], bak[o:e], 1.0, self._tmp(g.dtype, e - o))
