"""Two torchrun "nodes" of 2 processes each on loopback (c10d rendezvous): hsdp replicates across the
nodes, shards within each, and trains like one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_pool import free_port
from tests.distributed import training as T

ROOT = Path(__file__).resolve().parents[2]


def test_hsdp_across_two_torchrun_nodes(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        env.pop(key, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=meshkit-two-nodes", "--max-restarts=0",
        str(ROOT / "tests/e2e/two_node_train.py"), str(tmp_path),
    ]
    nodes = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        logs = [n.communicate(timeout=480)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert all(n.returncode == 0 for n in nodes), "\n".join(log[-3000:] for log in logs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    node_of = {r["rank"]: r["node"] for r in ranks}
    assert sorted(node_of.values()) == [0, 0, 1, 1]
    for r in ranks:
        assert r["environment"] == "TorchElasticEnvironment"
        assert r["degrees"] == {"dp_replicate": 2, "dp_shard": 2, "pp": 1, "cp": 1, "tp": 1}
        # shards inside this rank's node, replicas one per node
        assert {node_of[m] for m in r["groups"]["dp_shard"]} == {r["node"]} and len(r["groups"]["dp_shard"]) == 2
        assert sorted(node_of[m] for m in r["groups"]["dp_replicate"]) == [0, 1]
    want_losses, want_params = T.reference("meshkit", 5, 4)
    torch.testing.assert_close(torch.tensor(T.global_losses(ranks)), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(torch.load(tmp_path / "params.pt", weights_only=True), want_params)
