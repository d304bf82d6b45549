"""Checkpoint save time: meshkit's atomic, hashed save vs a plain DCP save of the same state, in one run.

Providers, interleaved round by round (the order alternating) so machine noise hits both alike, one
process, the demo model (``meshkit demo``'s LlamaConfig: dim 128, 4 layers, vocab 256) with AdamW
state, plus a larger model (dim 1024, 8 layers, vocab 32000: 1.9 GB, one rank's share of a mid-size job):

- ``dcp``      ``torch.distributed.checkpoint.save`` into the folder + ``torch.save(meta.pt)``: what
               Lightning's ModelParallelStrategy does (in place, no fsync of meta.pt, no manifest)
- ``meshkit``  :func:`meshkit.plugins.checkpoint.save_checkpoint`: ``.partial`` sibling, fsync,
               every file CRC-32'd as it is written, manifest, atomic rename over the previous checkpoint

and ``crc32_readback``: reading every file of the checkpoint back and CRC-32ing it, which is what the
save cost before files were hashed as written (and what verification on load costs). Reported: the
median, min and max of each provider's seconds, and the median / min / max of the per-round ratio
meshkit / dcp, in wall seconds and in the process's CPU seconds (less noisy on a shared machine).

    python benchmarks/checkpoint.py [--rounds 7] [--large]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from meshkit.models import LlamaConfig, LlamaLM  # noqa: E402
from meshkit.plugins.checkpoint import HASH, MANIFEST, save_checkpoint  # noqa: E402


def _state(config: LlamaConfig) -> tuple[dict, dict, int]:
    module = LlamaLM(config)
    opt = torch.optim.AdamW(module.parameters())
    module(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    opt.step()
    params = {k: v.detach() for k, v in module.state_dict().items()}
    optim = {f"state.{n}.{k}": v for n, p in module.named_parameters() for k, v in opt.state[p].items()}
    meta = {"global_step": 1, "epoch": 0, "hyper_parameters": {"lr": 3e-3}}
    numel = sum(v.numel() for v in params.values()) + sum(v.numel() for v in optim.values())
    return params, {"optim": optim, "meta": meta}, numel * 4


def _dcp(root: Path, params: dict, rest: dict) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    path = root / "plain.ckpt"
    t, c = time.perf_counter(), time.process_time()
    path.mkdir(exist_ok=True)
    dcp.save({"state_dict": params, "optimizer_0": rest["optim"]}, checkpoint_id=path, no_dist=True)
    torch.save(rest["meta"], path / "meta.pt")
    return time.perf_counter() - t, time.process_time() - c


def _meshkit(root: Path, params: dict, rest: dict) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    save_checkpoint(root / "last.ckpt", dict(params), [rest["optim"]], rest["meta"])
    return time.perf_counter() - t, time.process_time() - c


def _crc_readback(root: Path, *_: object) -> tuple[float, float]:
    import zlib

    t, c = time.perf_counter(), time.process_time()
    for f in (root / "last.ckpt").iterdir():
        if f.name != MANIFEST:
            with open(f, "rb") as fh:
                crc = 0
                while chunk := fh.read(1 << 22):
                    crc = zlib.crc32(chunk, crc)
    return time.perf_counter() - t, time.process_time() - c


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def run(config: LlamaConfig, rounds: int) -> dict:
    params, rest, nbytes = _state(config)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("MESHKIT_BENCH_DIR")) as tmp:
        root = Path(tmp)
        for i in range(rounds):
            order = [("dcp", _dcp), ("meshkit", _meshkit)]
            for name, provider in [*(order if i % 2 == 0 else order[::-1]), ("crc32_readback", _crc_readback)]:
                wall, cpu = provider(root, params, rest)
                times.setdefault(f"{name}_s", []).append(wall)
                times.setdefault(f"{name}_cpu_s", []).append(cpu)
        shutil.rmtree(root / "plain.ckpt", ignore_errors=True)
    out: dict = {"bytes": nbytes, **{k: _spread(v) for k, v in times.items()}}
    for kind in ("s", "cpu_s"):  # wall seconds, and this process's CPU seconds (less noisy on a shared box)
        mk, dc, rb = (times[f"{n}_{kind}"] for n in ("meshkit", "dcp", "crc32_readback"))
        out[f"meshkit_over_dcp_{kind}"] = {"of_medians": round(statistics.median(mk) / statistics.median(dc), 3),
                                           **{k: round(v, 3) for k, v in _spread([m / d for m, d in zip(mk, dc)]).items()}}
        out[f"readback_would_add_{kind}"] = round(statistics.median(rb) / statistics.median(dc), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--large", action="store_true", help="also the dim-1024, 8-layer, vocab-32000 model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    configs = {"demo": LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=128)}
    if args.large:
        configs["large"] = LlamaConfig(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=8)
    out = {name: run(cfg, args.rounds) for name, cfg in configs.items()}
    print(json.dumps({"hash": HASH, "rounds": args.rounds, **out}, indent=1))


if __name__ == "__main__":
    main()
