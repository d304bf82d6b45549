"""Run by torchrun as one of two "nodes": fit with strategy="hsdp", write what this rank saw to OUTDIR."""

import json
import os
import sys

import torch


def main(outdir: str) -> None:
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import meshkit  # noqa: F401
    from tests.distributed import training as T

    torch.set_num_threads(1)
    module = T.build_module("meshkit")
    recorder = T.LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy="hsdp", max_steps=5, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    trainer.fit(module, DataLoader(T.tokens(5 * T.PER_RANK_BATCH * 4), batch_size=T.PER_RANK_BATCH))
    dims = trainer.strategy.parallel_dims
    params = T.full_params(module)
    rank = dist.get_rank()
    out = {
        "rank": rank,
        "node": int(os.environ["GROUP_RANK"]),
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "degrees": dims.degrees,
        "dp_rank": dims.submesh("dp").get_local_rank(),
        "losses": recorder.losses,
        "groups": {a: dist.get_process_group_ranks(dims.mesh[a].get_group()) for a in ("dp_replicate", "dp_shard")},
    }
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if rank == 0:
        torch.save(params, os.path.join(outdir, "params.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
