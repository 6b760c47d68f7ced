"""The training demo's model: a two-layer MLP in numpy on scikit-learn's digits
(1797 8x8 images shipped with scikit-learn, no download), gradients by hand.

Kept apart from the training loop so another model can replace it: the loop only
needs ``KEYS``, ``init_params``, ``gradients`` and ``accuracy``."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

KEYS = ["W1", "b1", "W2", "b2"]


@dataclass(frozen=True)
class Data:
    """Train / test split, features scaled to [0, 1]."""

    xtr: np.ndarray
    ytr: np.ndarray
    xte: np.ndarray
    yte: np.ndarray

    def save(self, path: str) -> None:
        np.savez(path, xtr=self.xtr, ytr=self.ytr, xte=self.xte, yte=self.yte)


def load(path: str | None = None, seed: int = 0) -> Data:
    """The digits split (75 / 25, stratified, by ``seed``), or a saved split from
    ``path`` (the local launcher saves one, so the ranks need not import sklearn)."""
    if path and os.path.exists(path):
        with np.load(path) as z:
            return Data(z["xtr"], z["ytr"], z["xte"], z["yte"])
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise ImportError("the training demo needs scikit-learn: pip install "
                          "'rdmamw[examples]' (make installs it)") from e
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return Data(xtr, ytr.astype(np.int64), xte, yte.astype(np.int64))


def init_params(hidden: int, seed: int = 0, features: int = 64,
                classes: int = 10) -> list[np.ndarray]:
    """He-initialised weights (the same on every worker for the same seed)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((features, hidden)) * np.sqrt(2 / features)).astype(np.float32),
            np.zeros(hidden, np.float32),
            (rng.standard_normal((hidden, classes)) * np.sqrt(2 / hidden)).astype(np.float32),
            np.zeros(classes, np.float32)]


def forward(p: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.maximum(x @ p[0] + p[1], 0)
    return h, h @ p[2] + p[3]


def gradients(p: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Softmax cross-entropy gradients of a mini-batch (mean over its samples)."""
    h, z = forward(p, x)
    z = np.exp(z - z.max(1, keepdims=True))
    d = z / z.sum(1, keepdims=True)
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    dh = (d @ p[2].T) * (h > 0)
    return [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def accuracy(p: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float((forward(p, x)[1].argmax(1) == y).mean())
