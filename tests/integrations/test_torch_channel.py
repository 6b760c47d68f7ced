"""Tensors in the channel API (issue 30, item 3): send_batch / send / recv_into /
post_recv take CPU torch tensors and any ``__dlpack__`` exporter of host memory
directly (no ``.numpy()``), without a copy; device memory is refused with a
TypeError naming the device (rdmamw.memory.buffer.host_view)."""

from __future__ import annotations

import numpy as np
import pytest

from rdmamw.memory.buffer import host_view, owner
from tests.support.helpers import make_pair

torch = pytest.importorskip("torch")


class Producer:
    """A DLPack exporter and nothing else (no buffer protocol, not a tensor): what
    jax CPU arrays and other libraries hand over."""

    def __init__(self, t, device=None) -> None:
        self._t, self._device = t, device

    def __dlpack__(self, **kw):
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._device or self._t.__dlpack_device__()


class CudaArray:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1 << 20, False),
                                "version": 3}


@pytest.fixture
def pair():
    a, b, lst = make_pair(slots=8, slot_size=4096, rendezvous="read", rndv_threshold=1024)
    yield a, b
    a.close()
    b.close()
    lst.close()


def test_tensors_and_dlpack_arrays_are_sent_and_received_in_place(pair):
    a, b = pair
    small = torch.arange(10, dtype=torch.float32)
    big = torch.arange(50_000, dtype=torch.int64)                  # rendezvous
    half = torch.arange(6, dtype=torch.float32).to(torch.bfloat16)
    sent = a.send_batch([small, big, half, Producer(small)])
    got = b.recv(timeout=10)
    assert bytes(got) == small.numpy().tobytes()
    got.release()
    into = torch.zeros(50_000, dtype=torch.int64)
    assert b.recv_into(into, timeout=10) == big.numel() * 8
    assert torch.equal(into, big)                                   # written in place
    h = torch.zeros(6, dtype=torch.bfloat16)
    b.recv_into(h, timeout=10)
    assert torch.equal(h, half)
    p = torch.zeros(10)
    b.recv_into(Producer(p), timeout=10)                            # a DLPack destination
    assert torch.equal(p, small)
    sent.wait(10)
    posted = torch.zeros(50_000, dtype=torch.int64)
    b.post_recv(posted)
    sent = a.send(big * 2)
    m = b.recv(timeout=10)
    m.release()
    sent.wait(10)
    assert torch.equal(posted, big * 2)


def test_a_tensor_is_seen_through_its_storage_without_a_copy():
    t = torch.arange(8, dtype=torch.float32)
    v = host_view(t[2:])
    assert v.__array_interface__["data"][0] == t[2:].data_ptr()
    root = owner(v)                     # what the registration cache keys on
    assert root.data_ptr() == t.untyped_storage().data_ptr()
    w = host_view(Producer(t))
    assert w.__array_interface__["data"][0] == t.data_ptr()
    w[0] = 42
    assert t[0] == 42


@pytest.mark.parametrize("obj, words", [
    (lambda: torch.empty(4, device="meta"), "a meta tensor is device memory"),
    (lambda: Producer(torch.zeros(4), device=(2, 0)), "cuda:0 device memory"),
    (lambda: Producer(torch.zeros(4), device=(10, 1)), "rocm:1 device memory"),
    (lambda: CudaArray(), "CUDA device memory"),
    (lambda: torch.zeros(4).to_sparse(), "torch.sparse_coo tensor"),
    (lambda: torch.zeros(4, 4).t(), "C-contiguous"),
    (lambda: object(), "neither the buffer protocol nor __dlpack__"),
])
def test_device_sparse_and_strided_memory_is_refused_by_name(pair, obj, words):
    a, b = pair
    with pytest.raises(TypeError, match=words):
        a.send_batch([b"first", obj()])
    with pytest.raises(TypeError, match=words):
        b.recv_into(obj(), timeout=1)
    a.send(b"still usable").wait(10)
    m = b.recv(timeout=10)
    assert bytes(m) == b"still usable"          # nothing of the refused batch went
    m.release()


def test_a_numpy_array_still_goes_the_buffer_protocol_way(pair):
    a, b = pair
    x = np.arange(5, dtype=np.int32)
    a.send(x).wait(10)
    out = np.zeros(5, dtype=np.int32)
    b.recv_into(out, timeout=10)
    assert (out == x).all()
