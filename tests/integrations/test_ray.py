"""Ray's collective API on rdmamw (rdmamw.ray, issue 31 item 3): two Ray actors form
an "rdmamw" group and run every op of ``ray.util.collective`` on numpy arrays and
torch CPU tensors; each result is compared whole with what numpy computes from the
ranks' inputs. Also: register() is idempotent, and a group declared by the driver
(``create_collective_group``) is made in the actors on first use."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install rdmamw[ray]; "
                          "scripts/setup_ray.sh)")
pytest.importorskip("torch", reason="rdmamw.ray runs on the torch backend's process group "
                    "(scripts/setup_torch.sh)")
import ray.util.collective as col  # noqa: E402
from ray.util.collective.types import ReduceOp  # noqa: E402

import rdmamw.ray  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIZE = 2
SHAPE = (3, 1000)
OPS = {"sum": (ReduceOp.SUM, np.sum), "prod": (ReduceOp.PRODUCT, np.prod),
       "min": (ReduceOp.MIN, np.min), "max": (ReduceOp.MAX, np.max)}


def inputs(rank: int, n: int = 1, dtype: str = "float32") -> list[np.ndarray]:
    """Rank ``rank``'s ``n`` input arrays (the same on the driver and in the actor)."""
    rng = np.random.default_rng(100 + rank)
    return [(rng.integers(1, 5, SHAPE) * (rank + 1)).astype(dtype) for _ in range(n)]


@ray.remote(num_cpus=1)
class Member:
    """One rank: registers the backend (Ray's registry is per process), runs one op
    on its inputs and returns what its tensors hold afterwards, as numpy."""

    def __init__(self) -> None:
        rdmamw.ray.register()
        rdmamw.ray.register()           # idempotent

    def join(self, group: str, rank: int) -> None:
        col.init_collective_group(SIZE, rank, backend="rdmamw", group_name=group)

    def run(self, group: str, op: str, kind: str, arg: str = "") -> list[np.ndarray]:
        rank = col.get_rank(group)
        if rank < 0:            # declared by the driver: made on first use
            rank = _declared_rank(group)
        mine = inputs(rank, SIZE if op == "reducescatter" else 1)
        if kind == "torch":
            import torch
            ts = [torch.from_numpy(a.copy()) for a in mine]
        else:
            ts = [a.copy() for a in mine]
        t = ts[0]
        if op == "allreduce":
            col.allreduce(t, group, OPS[arg][0])
        elif op == "reduce":
            col.reduce(t, 1, group, OPS[arg][0])
        elif op == "broadcast":
            col.broadcast(t, 1, group)
        elif op == "allgather":
            outs = [np.zeros_like(mine[0]) for _ in range(SIZE)]
            if kind == "torch":
                import torch
                outs = [torch.from_numpy(o) for o in outs]
            col.allgather(outs, t, group)
            return [np.asarray(o) for o in outs]
        elif op == "reducescatter":
            out = np.zeros_like(mine[0])
            if kind == "torch":
                import torch
                out = torch.from_numpy(out)
            col.reducescatter(out, ts, group, OPS[arg][0])
            return [np.asarray(out), *(np.asarray(x) for x in ts)]
        elif op == "barrier":
            col.barrier(group)
        elif op == "sendrecv":          # 0 -> 1, then 1 -> 0: each receives into u
            u = t * 0
            for src in (0, 1):
                if rank == src:
                    col.send(t, 1 - src, group)
                else:
                    col.recv(u, src, group)
            return [np.asarray(u)]
        return [np.asarray(t)]

    def leave(self, group: str) -> None:
        col.destroy_collective_group(group)

    def mismatched(self, group: str) -> str:
        """An allreduce whose dtype differs by rank: the error each rank gets."""
        rank = col.get_rank(group)
        try:
            col.allreduce(np.ones(8, np.float32 if rank == 0 else np.int64), group)
        except Exception as e:  # noqa: BLE001 - its type is the answer
            return type(e).__name__
        return "no error"


def _declared_rank(group: str) -> int:
    col.get_group_handle(group)
    return col.get_rank(group)


@pytest.fixture(scope="module")
def members():
    # the actors import rdmamw from this tree, and this module (their class) by name
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests" / "integrations"),
                                       os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=SIZE, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        rdmamw.ray.register()
        ms = [Member.remote() for _ in range(SIZE)]
        ray.get([m.join.remote("g", r) for r, m in enumerate(ms)])
        yield ms
    finally:
        ray.shutdown()


def run(ms, op: str, kind: str, arg: str = "", group: str = "g") -> list[list[np.ndarray]]:
    return ray.get([m.run.remote(group, op, kind, arg) for m in ms])


KINDS = ["numpy", "torch"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(OPS))
def test_allreduce(members, kind, name):
    want = OPS[name][1](np.stack([inputs(r)[0] for r in range(SIZE)]), axis=0)
    for got in run(members, "allreduce", kind, name):
        np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["sum", "max"])
def test_reduce_to_rank_1(members, kind, name):
    want = OPS[name][1](np.stack([inputs(r)[0] for r in range(SIZE)]), axis=0)
    got = run(members, "reduce", kind, name)
    np.testing.assert_array_equal(got[1][0], want)
    np.testing.assert_array_equal(got[0][0], inputs(0)[0])     # not the root: unchanged


@pytest.mark.parametrize("kind", KINDS)
def test_broadcast_from_rank_1(members, kind):
    for got in run(members, "broadcast", kind):
        np.testing.assert_array_equal(got[0], inputs(1)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_allgather(members, kind):
    for got in run(members, "allgather", kind):
        assert len(got) == SIZE
        for r in range(SIZE):
            np.testing.assert_array_equal(got[r], inputs(r)[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["sum", "min"])
def test_reducescatter(members, kind, name):
    lists = [inputs(r, SIZE) for r in range(SIZE)]
    for rank, got in enumerate(run(members, "reducescatter", kind, name)):
        want = OPS[name][1](np.stack([lists[r][rank] for r in range(SIZE)]), axis=0)
        np.testing.assert_array_equal(got[0], want)
        for i in range(SIZE):       # the input list is left as it was
            np.testing.assert_array_equal(got[1 + i], lists[rank][i])


def test_barrier(members):
    assert len(run(members, "barrier", "numpy")) == SIZE


@pytest.mark.parametrize("kind", KINDS)
def test_send_recv(members, kind):
    got = run(members, "sendrecv", kind)
    for rank, g in enumerate(got):      # each holds the other's array
        np.testing.assert_array_equal(g[0], inputs(1 - rank)[0])


def test_a_mismatch_fails_on_every_rank_and_the_group_goes_on(members):
    """Ranks calling allreduce with different dtypes: every rank raises (no hang, no
    garbage), and the next collective on the group is right."""
    assert ray.get([m.mismatched.remote("g") for m in members]) == ["CollectiveMismatch"] * 2
    test_allreduce(members, "numpy", "sum")


def rank_1_first(members, group: str) -> None:
    """Make ``group``, rank 1 a second before rank 0; an allreduce on it is right;
    destroy it."""
    import time

    want = np.sum(np.stack([inputs(r)[0] for r in range(SIZE)]), axis=0)
    late = members[1].join.remote(group, 1)
    time.sleep(1.0)
    ray.get([members[0].join.remote(group, 0), late])
    for got in run(members, "allreduce", "numpy", "sum", group=group):
        np.testing.assert_array_equal(got[0], want)
    ray.get([m.leave.remote(group) for m in members])


def test_a_group_made_again_under_its_name_meets_afresh(members):
    """destroy, then init under the same name, rank 1 first: it must not find the
    first incarnation's endpoints in Ray's store (rank 0 removed them)."""
    for _ in range(2):
        rank_1_first(members, "again")


def test_a_group_made_again_after_a_dead_attempt_meets_afresh(members):
    """What an attempt that died while joining leaves under the name (a hello, an
    answer, its attempt's endpoints and here-keys), planted in Ray's store by the
    driver; the group made under that name, rank 1 first, meets afresh, and group
    "stale/x"'s key survives group "stale" clearing its own."""
    from rdmamw.ray.store import RayKV, group_root

    dead = RayKV(group_root("stale"), "127.0.0.1")
    dead.set("hello/1", b"0123456789abcdef")
    dead.set("answer/0123456789abcdef", b"deadbeefdeadbeef")
    old = dead.under("deadbeefdeadbeef")
    for key in ("here/1", "rdmamw/coll/job", "rdmamw/coll/desc/0", "rdmamw/coll/desc/1"):
        old.set(key, b"\x80")
    other = RayKV(group_root("stale/x"), "127.0.0.1")
    other.set("hello/1", b"kept")
    rank_1_first(members, "stale")
    assert other.get("hello/1") == b"kept"
    assert not old.check(["here/1"])
    other.clear()


def test_refuses_what_it_cannot_move():
    from unittest import mock

    g = rdmamw.ray.RdmamwGroup.__new__(rdmamw.ray.RdmamwGroup)
    g._pg = mock.Mock()
    with pytest.raises(TypeError, match="numpy arrays and torch CPU tensors, not list"):
        g.allreduce([[1.0, 2.0]])
    with pytest.raises(ValueError, match="one tensor per process"):
        g.broadcast([np.zeros(2), np.zeros(2)])
    assert not g._pg.method_calls       # refused before anything is sent


def test_group_declared_by_the_driver(members):
    """``create_collective_group`` on the driver (which needs register() there too):
    the actors make their group on first use."""
    col.create_collective_group(members, SIZE, list(range(SIZE)), backend="rdmamw",
                                group_name="decl")
    want = np.sum(np.stack([inputs(r)[0] for r in range(SIZE)]), axis=0)
    for got in run(members, "allreduce", "numpy", "sum", group="decl"):
        np.testing.assert_array_equal(got[0], want)


def test_register_is_idempotent():
    from ray.util.collective.backend_registry import _global_registry

    assert rdmamw.ray.register() == rdmamw.ray.register() == "rdmamw"
    assert _global_registry.get("RDMAMW") is rdmamw.ray.RdmamwGroup
    assert col.is_backend_available("rdmamw")


def test_calls_run_in_the_callers_thread():
    """Every collective asks the torch group for a blocking run (``asyncOp`` False):
    the default, True, hands each call to the progress thread and back (1 MiB
    allreduce 0.95 -> 0.39 ms in bench/ray_bench.py's actors)."""
    seen = []

    class Done:
        def wait(self):
            return True

    class Group:
        def __getattr__(self, name):
            def call(*args):
                seen.append((name, args[-1]))
                return Done()
            return call

    g = rdmamw.ray.RdmamwGroup.__new__(rdmamw.ray.RdmamwGroup)
    g._pg, a = Group(), np.zeros(4, np.float32)
    g.allreduce([a])
    g.reduce([a])
    g.broadcast([a])
    g.allgather([[a, a]], [a])
    g.reducescatter([a], [[a, a]])
    g.barrier()
    assert [n for n, _ in seen] == ["allreduce", "reduce", "broadcast", "allgather",
                                    "reduce_scatter", "barrier"]
    assert all(o.asyncOp is False for _, o in seen), [(n, o.asyncOp) for n, o in seen]


def test_a_failed_first_barrier_closes_the_group():
    """The group's first barrier fails (a member died while joining): its channels
    and listeners are closed, the error goes to Ray's caller."""
    from unittest import mock

    from rdmamw.errors import Timeout

    pg = mock.Mock()
    pg.barrier.return_value.wait.side_effect = Timeout("barrier: Timed out")
    with mock.patch("rdmamw.ray.group.meet"), \
            mock.patch("rdmamw.torch.backend.ProcessGroupRdmamw", return_value=pg), \
            pytest.raises(Timeout):
        rdmamw.ray.RdmamwGroup(2, 1, "dead")
    pg.shutdown.assert_called_once_with()
