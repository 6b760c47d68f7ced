"""The rdmamw backend beside gloo in one process, each rank a thread (a group object
per rank over one HashStore, no torch.distributed world: seconds, not a job per
test): ReduceOp.AVG on every dtype against gloo's own result, PREMUL_SUM (which
gloo refuses) against its definition, per-call and per-group timeouts against
gloo's error type, and batch_isend_irecv posting one batch per peer."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from rdmamw.torch import ProcessGroupRdmamw, UnsupportedOp  # noqa: E402

R = dist.ReduceOp


def ranks(n: int, fn: Callable[[Any, int], Any], backend: str = "rdmamw",
          timeout: float = 20.0, store: Any = None) -> list[Any]:
    """``fn(group, rank)`` on ``n`` threads, each with its rank's group of ``backend``
    ("rdmamw" or "gloo"); their results (an exception a thread raised is raised).
    Each group is known to torch's group table for the call (``dist.P2POp``, torch's
    rank translations look there), with group rank = global rank."""
    store = store if store is not None else dist.HashStore()
    out: list[Any] = [None] * n
    errs: list[BaseException | None] = [None] * n
    td = datetime.timedelta(seconds=timeout)

    def one(r: int) -> None:
        try:
            if backend == "gloo":
                pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), r, n, td)
            else:
                pg = ProcessGroupRdmamw(dist.PrefixStore("rdmamw", store), r, n, td)
            table = dist.distributed_c10d._world.pg_group_ranks
            table[pg] = {g: g for g in range(n)}
            try:
                out[r] = fn(pg, r)
            finally:
                del table[pg]
                if backend != "gloo":
                    pg.shutdown()
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            errs[r] = e

    ts = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a rank hangs"
    for e in errs:
        if e is not None:
            raise e
    return out


def _opts(kind: str, op: Any, async_op: bool = True) -> Any:
    o = {"allreduce": dist.AllreduceOptions, "reduce": dist.ReduceOptions,
         "coalesced": dist.AllreduceCoalescedOptions}.get(kind, dist.ReduceScatterOptions)()
    o.reduceOp = op
    o.asyncOp = async_op
    return o


def _input(r: int, dtype: torch.dtype, n: int = 12) -> torch.Tensor:
    """Rank r's input: fractions for floating point (16-bit sums round), small
    integers otherwise."""
    g = torch.Generator().manual_seed(100 + r)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(0 if dtype == torch.uint8 else -9, 10, (n,), generator=g).to(dtype)


#: the reductions that take a reduce op, each as (group, rank, tensor, op) -> the
#: tensor its rank ends with (what torch's own functions call on the group)
def _allreduce(pg, r, t, op, async_op=True):
    t = t.clone()
    pg.allreduce([t], _opts("allreduce", op, async_op)).wait()
    return t


def _reduce(pg, r, t, op):
    t = t.clone()
    o = _opts("reduce", op)
    o.rootRank = 1
    pg.reduce([t], o).wait()
    return t if r == 1 else None       # gloo leaves the others' tensors as scratch


def _reduce_scatter(pg, r, t, op):
    out = torch.empty(t.shape[0] // 2, dtype=t.dtype)
    pg.reduce_scatter([out], [list(t.chunk(2))], _opts("rs", op)).wait()
    return out


def _reduce_scatter_tensor(pg, r, t, op):
    out = torch.empty(t.shape[0] // 2, dtype=t.dtype)
    # torch calls reduce_scatter_single on a ProcessGroup; gloo's Backend has it as
    call = pg._reduce_scatter_base if backend_of(pg) == "gloo" else pg.reduce_scatter_single
    call(out, t, _opts("rs", op)).wait()
    return out


def _coalesced(pg, r, t, op):
    ts = [t[:5].clone(), t[5:].clone()]
    pg.allreduce_coalesced(ts, _opts("coalesced", op)).wait()
    return torch.cat(ts)


def backend_of(pg: Any) -> str:
    return "gloo" if isinstance(pg, dist.ProcessGroupGloo) else "rdmamw"


CALLS = {"all_reduce": _allreduce, "reduce": _reduce, "reduce_scatter": _reduce_scatter,
         "reduce_scatter_tensor": _reduce_scatter_tensor,
         "all_reduce_coalesced": _coalesced}
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
INTEGERS = [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool]


def _each(call: Callable, dtype: torch.dtype, op: Any) -> Callable:
    """``call`` as torch's functions make it (a complex tensor as its real view)."""
    def fn(pg, r):
        t = _input(r, dtype)
        if dtype.is_complex:
            t = torch.view_as_real(t).reshape(-1)
        return call(pg, r, t, op)
    return fn


def test_avg_on_floating_point_equals_gloos_result():
    """AVG at 2 ranks, every floating-point dtype gloo takes (complex as torch hands
    it over, its real view) and every reduction with an op: rdmamw's tensors equal
    gloo's bit for bit (float16 / bfloat16 reduce in float32 here and in 16 bits in
    gloo, but (a + b) / 2 rounded once is round(a + b) / 2 away from the extremes)."""
    for dtype in FLOATS:
        for name, call in CALLS.items():
            fn = _each(call, dtype, R.AVG)
            want, got = ranks(2, fn, "gloo"), ranks(2, fn)
            for r in range(2):
                if want[r] is not None:
                    assert torch.equal(got[r], want[r]), (dtype, name, r, got[r], want[r])


def test_avg_on_integers_fails_as_on_gloo_and_the_group_stays_usable():
    """gloo sums, then fails dividing an integer or bool tensor in place: a
    RuntimeError from wait() on every rank. rdmamw refuses at the call, before
    anything is sent, with UnsupportedOp, a RuntimeError too; the tensor is as it
    was and the next collective pairs up."""
    def attempt(pg, r, dtype):
        t = _input(r, dtype)
        before = t.clone()
        try:
            pg.allreduce([t], _opts("allreduce", R.AVG)).wait()
        except RuntimeError as e:
            return e, before, t
        raise AssertionError(f"AVG on {dtype} did not fail")

    for dtype in INTEGERS:
        gloo = ranks(2, lambda pg, r, d=dtype: attempt(pg, r, d)[0], "gloo")
        assert all("can't be cast" in str(e) for e in gloo), gloo

        def ours(pg, r, d=dtype):
            e, before, t = attempt(pg, r, d)
            after = torch.full((4,), float(r))
            pg.allreduce([after], _opts("allreduce", R.SUM)).wait()
            return e, torch.equal(before, t), after.tolist()

        for e, untouched, after in ranks(2, ours):
            assert isinstance(e, UnsupportedOp) and "AVG needs a floating-point" in str(e), e
            assert untouched and after == [1.0] * 4


@pytest.mark.parametrize("factor", [0.25, 3, "tensor"])
def test_premul_sum_scales_each_rank_then_sums(factor):
    """PREMUL_SUM (``dist._make_nccl_premul_sum(f)``, FSDP's
    ``ReduceOp.PREMUL_SUM(1 / n)``; gloo refuses it): sum over ranks of f * x_r, f
    a number or a one-element tensor, in every reduction; float16 / bfloat16 scaled
    and summed in float32, rounded once; the caller's inputs are not scaled."""
    f = torch.tensor([0.375], dtype=torch.float64) if factor == "tensor" else factor
    fv = float(f[0]) if factor == "tensor" else float(f)
    op = dist._make_nccl_premul_sum(f) if factor != 3 else R.PREMUL_SUM(f)

    def want(dtype):
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return sum(_input(r, dtype).to(wide) * fv for r in range(2)).to(dtype)

    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        total = want(dtype)

        def fn(pg, r, d=dtype):
            x = _input(r, d)
            res = {name: call(pg, r, x, op) for name, call in CALLS.items()}
            assert torch.equal(x, _input(r, d))             # the input is not scaled
            return res

        for r, res in enumerate(ranks(2, fn)):
            half = total.chunk(2)[r]
            for name, got in res.items():
                w = half if name.startswith("reduce_scatter") else total
                if got is not None:
                    assert torch.equal(got, w), (dtype, name, r, got, w)
    with pytest.raises(RuntimeError, match="Cannot use ReduceOp.PREMUL_SUM with Gloo"):
        ranks(2, _each(_allreduce, torch.float32, op), "gloo")


def test_premul_sum_refuses_integers_and_odd_factors_before_sending():
    def fn(pg, r):
        errors = []
        premul = dist._make_nccl_premul_sum
        for t, op in ((torch.ones(3, dtype=torch.int32), premul(2.0)),
                      (torch.ones(3), premul(torch.ones(1, dtype=torch.complex64))),
                      (torch.ones(3), premul(torch.ones(1, device="meta")))):
            with pytest.raises(UnsupportedOp) as e:
                pg.allreduce([t], _opts("allreduce", op))
            errors.append(str(e.value))
        t = torch.ones(3)
        pg.allreduce([t], _opts("allreduce", R.SUM)).wait()       # nothing was sent
        return errors, t.tolist()

    for errors, after in ranks(2, fn):
        assert "PREMUL_SUM needs a floating-point tensor, not torch.int32" in errors[0]
        assert "one-element real CPU tensor, not torch.complex64" in errors[1], errors
        assert "meta" in errors[2], errors
        assert after == [2.0] * 3


# ---- timeouts ------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[BaseException | None, float]:
    t0 = time.monotonic()
    try:
        fn()
        return None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - the test reads it
        return e, time.monotonic() - t0


def _barrier(pg: Any, secs: float | None = None, async_op: bool = False) -> Any:
    o = dist.BarrierOptions()
    o.asyncOp = async_op
    if secs is not None:
        o.timeout = datetime.timedelta(seconds=secs)     # what dist.barrier(timeout=) sets
    return pg.barrier(o).wait()


@pytest.mark.parametrize("backend", ["gloo", "rdmamw"])
def test_work_wait_past_its_timeout_raises_and_the_operation_goes_on(backend):
    """``work.wait(timeout)`` on an all_reduce rank 1 joins late: a RuntimeError
    (torch's DistBackendError for rdmamw, gloo's "Operation timed out!") within the
    timeout; the all_reduce goes on, a later wait sees it done with the right sum,
    and the group stays usable, as on gloo."""
    def fn(pg, r):
        t = torch.full((4,), float(r + 1))
        if r == 1:
            time.sleep(2.5)
        w = pg.allreduce([t], _opts("allreduce", R.SUM))
        err, took = _timed(lambda: w.wait(datetime.timedelta(seconds=0.3))) if r == 0 \
            else (None, 0.0)
        w.wait()
        after = torch.ones(2)
        pg.allreduce([after], _opts("allreduce", R.SUM)).wait()
        return err, took, t.tolist(), after.tolist()

    (err, took, t, after), one = ranks(2, fn, backend)
    assert isinstance(err, RuntimeError) and "timed out" in str(err).lower(), err
    assert 0.3 <= took < 0.3 + 1.9, took         # rank 1 comes at 2.5 s (a loaded CI)
    if backend == "rdmamw":
        assert isinstance(err, dist.DistBackendError) and isinstance(err, TimeoutError)
    assert t == one[2] == [3.0] * 4 and after == one[3] == [2.0, 2.0]


@pytest.mark.parametrize("backend", ["gloo", "rdmamw"])
@pytest.mark.parametrize("own", [True, False], ids=["per-call", "per-group"])
def test_a_barrier_past_its_timeout_fails_cleanly_on_every_rank(backend, own):
    """A barrier rank 1 comes to 3.5 s late: with ``dist.barrier(timeout=1 s)`` in a
    group of 20 s (per call), or a blocking barrier in a group made with timeout=1 s
    (``new_group(timeout=)``, asynchronously here): rank 0 raises a RuntimeError
    saying it timed out within the timeout; the group is then broken, as gloo's:
    rank 0's next call and rank 1's late barrier raise at once, nobody hangs."""
    def fn(pg, r):
        _barrier(pg)                            # channels open, both ranks here
        if r == 1:
            time.sleep(3.5)
            return _timed(lambda: _barrier(pg))
        first = _timed(lambda: _barrier(pg, 1.0) if own else _barrier(pg, async_op=True))
        return first, _timed(lambda: _barrier(pg))

    ((first, took), (after, after_took)), (late, late_took) = ranks(
        2, fn, backend, timeout=20.0 if own else 1.0)
    assert isinstance(first, RuntimeError) and "timed out" in str(first).lower(), first
    assert 1.0 <= took < 1.0 + 2.0, took         # rank 1 comes at 3.5 s
    if backend == "rdmamw":
        assert isinstance(first, dist.DistBackendError) and isinstance(first, TimeoutError)
    assert after is not None and after_took < 0.5, (after, after_took)
    assert late is not None and late_took < 0.5, (late, late_took)


# ---- batch_isend_irecv ---------------------------------------------------------------


def _p2p_batches(pg: Any) -> dict[int, int]:
    """The send_batch calls so far on each point-to-point channel of the group."""
    return {peer: ch.stats()["batches"] for peer, ch in pg.p2p._chans.items()}


def test_batch_isend_irecv_posts_one_batch_per_peer():
    """torch's ``dist.batch_isend_irecv`` on an rdmamw group (3 ranks): rank 0's 4
    sends to rank 1 and 3 to rank 2, interleaved with its receives, go as one
    ``send_batch`` per peer (the channels' ``stats()["batches"]``), not one per
    tensor; every tensor arrives whole, in order; dist._coalescing_manager (torch's
    own protocol) batches the same way."""
    def fn(pg, r):
        for p in range(3):                      # open the channels both ways
            if p != r:
                pg.send([torch.zeros(1)], p, 0).wait()
        for p in range(3):
            if p != r:
                pg.recv([torch.zeros(1)], p, 0).wait()
        if r != 0:
            k = 4 if r == 1 else 3
            got = [torch.empty(5) for _ in range(k)]
            ws = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, torch.full((2,), float(r)), group=pg, group_peer=0)]
                + [dist.P2POp(dist.irecv, g, group=pg, group_peer=0) for g in got])
            for w in ws:
                w.wait()
            ws = [dist.irecv(g, group=pg, group_src=0) for g in got]
            for w in ws:
                w.wait()
            return [g.tolist() for g in got]
        before = _p2p_batches(pg)
        back = {1: torch.empty(2), 2: torch.empty(2)}
        ops = []
        for i in range(4):
            for p in (1, 2)[: 2 if i < 3 else 1]:
                ops.append(dist.P2POp(dist.isend, torch.full((5,), 10.0 * p + i), group=pg,
                                      group_peer=p))
                if i == 1:
                    ops.append(dist.P2POp(dist.irecv, back[p], group=pg, group_peer=p))
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        mid = _p2p_batches(pg)
        with dist._coalescing_manager(pg, torch.device("cpu"), async_ops=True) as cm:
            for i in range(4):
                for p in (1, 2)[: 2 if i < 3 else 1]:
                    dist.isend(torch.full((5,), 10.0 * p + i), group=pg, group_dst=p)
        cm.wait()
        after = _p2p_batches(pg)
        return ({p: mid[p] - before[p] for p in (1, 2)},
                {p: after[p] - mid[p] for p in (1, 2)}, {p: t.tolist() for p, t in back.items()})

    (batched, managed, back), one, two = ranks(3, fn)
    assert batched == {1: 1, 2: 1} and managed == {1: 1, 2: 1}, (batched, managed)
    assert back == {1: [1.0, 1.0], 2: [2.0, 2.0]}
    assert one == [[10.0 + i] * 5 for i in range(4)] and two == [[20.0 + i] * 5 for i in range(3)]


def test_coalescing_manager_waits_for_the_coalesced_collective_and_receives():
    """``dist._coalescing_manager(group, device, async_ops=True)``: torch hands the
    all_reduces of the block to ``allreduce_coalesced`` and then keeps only the Work
    of ``_end_coalescing``: that Work must cover the coalesced all_reduce and the
    receives of the block, so that ``cm.wait()`` means the tensors are there."""
    def fn(pg, r):
        ts = [torch.full((1 << 20,), float(r + k)) for k in range(2)]
        got = torch.empty(1 << 20)
        with dist._coalescing_manager(pg, torch.device("cpu"), async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, group=pg)
            dist.isend(torch.full((1 << 20,), 7.0 + r), group=pg, group_dst=1 - r)
            dist.irecv(got, group=pg, group_src=1 - r)
        cm.wait()
        return [t[-1].item() for t in ts], got[-1].item()

    assert ranks(2, fn) == [([1.0, 3.0], 8.0), ([1.0, 3.0], 7.0)]
