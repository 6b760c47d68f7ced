"""Ray Train on the torch backend "rdmamw" (issue 31 item 3; docs/ray.md): a
``TorchTrainer`` of two workers with ``TorchConfig(backend="rdmamw")`` and
``rdmamw.torch.register`` as Ray's ``worker_process_setup_hook`` runs an all_reduce
(compared whole) and a DDP step in each worker. Slow (~40 s: Ray Train's controller
and workers start on 2 cores): ``make test-slow``."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install rdmamw[ray])")
pytest.importorskip("torch", reason="torch is not installed (scripts/setup_torch.sh)")
try:
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
except ImportError as e:        # ray.train needs more than plain ray (pydantic, ...)
    pytest.skip(f"ray.train is not importable: {e}", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]
N = 1000


def _loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    assert dist.get_backend() == "rdmamw", dist.get_backend()
    r = dist.get_rank()
    t = torch.arange(N, dtype=torch.float32) * (r + 1)
    dist.all_reduce(t)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    model(torch.ones(8, 4)).sum().backward()
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    np.save(os.path.join(config["out"], f"sum{r}.npy"), t.numpy())
    np.save(os.path.join(config["out"], f"grad{r}.npy"), np.concatenate(
        [g.reshape(-1) for g in grads]))


@pytest.mark.slow
def test_torch_trainer_on_rdmamw(tmp_path):
    # the workers import rdmamw from this tree, and this module (the loop) by name
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests" / "integrations"),
                                       os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path},
                          "worker_process_setup_hook": "rdmamw.torch.register"})
    try:
        TorchTrainer(_loop, train_loop_config={"out": str(tmp_path)},
                     scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                  resources_per_worker={"CPU": 1}),
                     torch_config=TorchConfig(backend="rdmamw")).fit()
    finally:
        ray.shutdown()
    want = np.arange(N, dtype=np.float32) * 3
    for r in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f"sum{r}.npy"), want)
    # DDP averaged the gradients: the same on both workers
    np.testing.assert_array_equal(np.load(tmp_path / "grad0.npy"),
                                  np.load(tmp_path / "grad1.npy"))
