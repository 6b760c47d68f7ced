"""CPU tensors as numpy arrays without a copy, and torch's reduce ops as rdmamw's.

numpy has no bfloat16: a bfloat16 tensor moves as its uint16 bits, and reductions of
bfloat16 and float16 run in float32 (one rounding at the end, as a float32 sum of
the ranks' values rounded once), never in the 16-bit type. bool reduces as "or"
(SUM, MAX, BOR) and "and" (PRODUCT, MIN, BAND)."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed import ReduceOp

from rdmamw.errors import RdmamwError


class UnsupportedTensor(RdmamwError, TypeError):
    """A tensor the rdmamw backend cannot move: not on the CPU, sparse, or of a dtype
    it does not carry. Raised before anything is sent."""


class UnsupportedOp(RdmamwError, ValueError, RuntimeError):
    """A reduce op the rdmamw backend does not have for this dtype (raised before
    anything is sent). Also a RuntimeError: what gloo raises for the same calls (AVG
    on an integer tensor), so code written against gloo catches it."""


#: torch dtype -> the numpy dtype it travels as
WIRE = {
    torch.float16: np.float16, torch.bfloat16: np.uint16, torch.float32: np.float32,
    torch.float64: np.float64, torch.int8: np.int8, torch.int16: np.int16,
    torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.bool_,
}
#: dtypes reduced in float32
WIDEN = (torch.float16, torch.bfloat16)
#: dtypes reduced as they are (numpy has them: no staging)
PLAIN = frozenset(WIRE) - set(WIDEN)
#: int(RedOpType) -> rdmamw's name (an options' ReduceOp object holds it in ``.op``)
OPS = {int(ReduceOp.SUM): "sum", int(ReduceOp.PRODUCT): "prod", int(ReduceOp.MIN): "min",
       int(ReduceOp.MAX): "max", int(ReduceOp.BAND): "band", int(ReduceOp.BOR): "bor",
       int(ReduceOp.BXOR): "bxor", int(ReduceOp.AVG): "avg",
       int(ReduceOp.PREMUL_SUM): "premul_sum"}
#: the ops that reduce as a sum, then (AVG) or before (PREMUL_SUM) scale
SCALED = ("avg", "premul_sum")


def check(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise UnsupportedTensor(f"expected a torch.Tensor, not {type(t).__name__}")
    if not t.is_cpu:
        raise UnsupportedTensor(
            f"the rdmamw backend moves CPU tensors only, not {t.device} ones; copy it to "
            f"the CPU (t.cpu()) or use a GPU backend (nccl) for {t.device.type} tensors")
    if t.layout != torch.strided:
        raise UnsupportedTensor(f"the rdmamw backend needs dense tensors, not {t.layout}")
    if t.dtype not in WIRE:
        names = ", ".join(str(d).replace("torch.", "") for d in WIRE)
        raise UnsupportedTensor(f"dtype {t.dtype} is not supported by the rdmamw backend; "
                                f"use one of {names}")


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array of its wire dtype (no copy); ``t`` must
    be contiguous. A tensor that requires grad gives its data (DDP with
    ``create_graph=True`` reduces such gradients)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def label(op: object) -> str:
    """``ReduceOp.SUM`` for any form of it (options hold objects that print badly)."""
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR",
                 "PREMUL_SUM", "UNUSED"):
        try:
            if op == getattr(ReduceOp, name):
                return f"ReduceOp.{name}"
        except (AttributeError, TypeError):
            continue
    return repr(op)


#: (op type, dtype) -> rdmamw's name, for the pairs op_name accepted (a call's cost)
_NAMES: dict = {}


def op_name(op: object, dtype: torch.dtype) -> str:
    """rdmamw's name of torch reduce op ``op`` on ``dtype`` ("avg" is sum then a
    division, "premul_sum" each rank's tensor times the op's factor then a sum:
    floating point only), or UnsupportedOp."""
    kind = getattr(op, "op", op)
    key = (getattr(kind, "value", kind), dtype)     # an int: hashes and compares fast
    try:
        return _NAMES[key]
    except (KeyError, TypeError):       # new pair, or an unhashable op
        name = _op_name(op, dtype)
    if type(kind) is ReduceOp.RedOpType:
        _NAMES[key] = name
    return name


def _op_name(op: object, dtype: torch.dtype) -> str:
    try:
        name = OPS.get(int(getattr(op, "op", op)))
    except (TypeError, ValueError):
        name = None
    if name is None:
        raise UnsupportedOp(f"reduce op {label(op)} is not supported by the rdmamw backend; "
                            f"use SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM, BAND, BOR or "
                            f"BXOR")
    floating = dtype.is_floating_point
    if name in ("band", "bor", "bxor") and floating:
        raise UnsupportedOp(f"{label(op)} needs an integer or bool tensor, not {dtype}")
    if name == "avg" and not floating:
        # gloo sums, then fails dividing in place ("result type Float can't be cast to
        # the desired output type Int"): an error there too, here before sending
        raise UnsupportedOp(f"AVG needs a floating-point tensor, not {dtype} (use SUM and "
                            f"divide; gloo refuses it too)")
    if name == "premul_sum" and not floating:
        raise UnsupportedOp(f"PREMUL_SUM needs a floating-point tensor, not {dtype} (as "
                            f"nccl's)")
    return name


def premul_factor(op: object) -> float:
    """The factor of a PREMUL_SUM op (``dist._make_nccl_premul_sum(f)``,
    ``ReduceOp.PREMUL_SUM(f)``): a number, or a one-element CPU tensor read now."""
    f = op.factor
    if isinstance(f, torch.Tensor):
        if f.numel() != 1 or not f.is_cpu or f.is_complex():
            raise UnsupportedOp(f"PREMUL_SUM's factor must be a number or a one-element "
                                f"real CPU tensor, not {f.dtype}{list(f.shape)} on {f.device}")
        return float(f.item())
    return float(f)
