"""MFU of a Llama-3-8B-shaped model on one GPU, with meshkit's fused kernels and per-block torch.compile.

Llama-3-8B at full width (hidden 4096, 32 query / 8 kv heads of 128, SwiGLU 14336, vocab 128256,
rope theta 5e5) but only a few layers, so that it fits one GPU without sharding and compiles in
seconds. Each depth in ``--depths`` (default 2 and 4 layers) is timed as a full training step
(forward with the fused loss, backward, AdamW step) in bf16; the step time is fitted as
``t(L) = a + b·L`` (``a``: embedding, LM head and loss; ``b``: one block) and MFU is reported three ways:

- ``measured``: for each depth, model FLOPs of that depth ÷ (its step time × peak);
- ``per_layer``: one block's model FLOPs ÷ (``b`` × peak);
- ``extrapolated_32``: the 32-layer model's FLOPs ÷ ((a + 32·b) × peak). An extrapolation of time
  only: the real 32-layer model does not fit one GPU with AdamW states unsharded, and at that size
  memory effects (allocator, activation checkpointing) would move it.

Model FLOPs per token are :func:`meshkit.profiling.flops.model_flops_per_token` (PaLM's 6·N + 12·L·H·Q·T,
no recompute); the peak is :func:`meshkit.profiling.flops.peak_info` (datasheet dense bf16 for the GPU).

    python benchmarks/gpu/mfu_8b.py --json mfu.json            # on a CUDA machine
    python benchmarks/gpu/mfu_8b.py --cpu --json mfu.json      # tiny shapes, fp32, compile backend "eager"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from meshkit.integrations import apply_fused_kernels  # noqa: E402
from meshkit.models import LlamaConfig, Transformer  # noqa: E402
from meshkit.profiling.flops import model_flops_per_token, peak_info  # noqa: E402

__all__ = ["llama3_8b_width", "time_steps", "fit_and_mfu", "main"]


def llama3_8b_width(n_layers: int, *, tiny: bool = False) -> LlamaConfig:
    """Llama-3-8B's shape with ``n_layers`` blocks (``tiny``: the same code path at hidden 64).

    >>> llama3_8b_width(2).ffn_dim
    14336
    """
    if tiny:
        return LlamaConfig(vocab_size=256, dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=160,
                           rope_theta=500000.0, max_seq_len=64)
    return LlamaConfig(vocab_size=128256, dim=4096, n_layers=n_layers, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                       rope_theta=500000.0, max_seq_len=8192)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(cfg: LlamaConfig, *, device: str, dtype: torch.dtype, batch: int, seq: int, steps: int,
               warmup: int, fused: bool, compile_backend: str | None, fastest: bool = False) -> dict[str, Any]:
    """Median seconds of one training step (fused-loss forward, backward, AdamW) of ``Transformer(cfg)``; with
    ``fastest``, the fastest step instead (the CPU dry run: other processes on a shared host only add time, and
    a median of a few steps on a loaded 2-core machine moved by more than one tiny block's time)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg).to(dtype)
    patched = apply_fused_kernels(model) if fused else {}
    if compile_backend:  # per-block compile, as meshkit.parallelize does (after kernels, before sharding)
        for block in model.layers.values():
            block.compile(backend=compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        if fused:
            loss = model(inputs, labels=labels)
        else:
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step()
    _sync(device)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"layers": cfg.n_layers, "step_s": min(times) if fastest else statistics.median(times),
            "step_s_all": times,
            "warmup_s": first_s, "loss": loss, "patched": patched, "peak_mem_gib": peak_mem}


def fit_and_mfu(rows: list[dict[str, Any]], cfg_of: Any, *, tokens: int, seq: int, peak: float,
                target_layers: int = 32) -> dict[str, Any]:
    """Fit ``t(L) = a + b·L`` through the measured depths and turn it into MFU (module docstring).

    >>> cfg_of = lambda n: llama3_8b_width(n, tiny=True)
    >>> r = fit_and_mfu([{"layers": 1, "step_s": 3.0}, {"layers": 2, "step_s": 5.0}], cfg_of,
    ...                 tokens=64, seq=64, peak=1e9)
    >>> r["fit"]["per_layer_s"], r["fit"]["fixed_s"]
    (2.0, 1.0)
    >>> fit_and_mfu([{"layers": 1, "step_s": 3.0}, {"layers": 2, "step_s": 2.9}], cfg_of,
    ...             tokens=64, seq=64, peak=1e9)["mfu_extrapolated_32"] is None
    True
    """
    if len(rows) < 2:
        raise ValueError(f"fit_and_mfu: `len(rows)={len(rows)}`: the fit needs two depths; pass --depths 2,4.")
    xs = [r["layers"] for r in rows]
    ys = [r["step_s"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx

    def flops(n: int) -> float:  # model FLOPs of one step of the n-layer model
        return model_flops_per_token(cfg_of(n), seq) * tokens

    measured = {str(r["layers"]): flops(r["layers"]) / (r["step_s"] * peak) for r in rows}
    per_layer_flops = flops(2) - flops(1)  # one block (the rest cancels)
    t_target = a + b * target_layers
    fit: dict[str, Any] = {"fixed_s": a, "per_layer_s": b}
    if b <= 0:  # noise larger than one block's time: no per-layer or extrapolated figure, and say so
        fit["warning"] = (f"step time does not grow with depth (per layer {b:.3g} s): timing noise exceeds one "
                          "block's time; time more --steps or depths further apart")
    return {
        "fit": fit,
        "mfu_measured": measured,
        "mfu_per_layer": per_layer_flops / (b * peak) if b > 0 else None,
        f"mfu_extrapolated_{target_layers}": (flops(target_layers) / (t_target * peak)
                                              if b > 0 and t_target > 0 else None),
        f"step_s_extrapolated_{target_layers}": t_target,
        "model_flops_per_token": {str(n): model_flops_per_token(cfg_of(n), seq) for n in xs + [target_layers]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU, fp32, compile backend 'eager'")
    ap.add_argument("--depths", default=None, help="layer counts to time (default 2,4; --cpu 1,4)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 2; --cpu 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; --cpu 32)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per depth (default 10; --cpu 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    ap.add_argument("--variants", default="meshkit+compile,compile",
                    help="comma list of meshkit+compile, compile, meshkit, eager")
    ap.add_argument("--budget-s", type=float, default=100.0, help="start no new variant after this many seconds")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    cpu = a.cpu or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    depths = [int(x) for x in (a.depths or ("1,4" if cpu else "2,4")).split(",")]
    batch, seq = a.batch or 2, a.seq or (32 if cpu else 4096)
    steps = a.steps or (3 if cpu else 10)
    if cpu:
        torch.set_num_threads(1)
    device_name = "cpu" if cpu else torch.cuda.get_device_name()
    peak = peak_info(device_name, dtype)

    def cfg_of(n: int) -> LlamaConfig:
        return llama3_8b_width(n, tiny=cpu)

    out: dict[str, Any] = {"device": device_name, "dtype": str(dtype), "batch": batch, "seq": seq,
                           "tokens_per_step": batch * seq, "steps": steps, "depths": depths,
                           "peak": {"flops": peak.flops, "row": peak.row, "kind": peak.kind, "source": peak.source},
                           "shape": "tiny (dry run)" if cpu else "Llama-3-8B width", "variants": {}}
    t_start = time.perf_counter()
    for variant in [v for v in a.variants.split(",") if v]:
        if time.perf_counter() - t_start > a.budget_s:
            out["variants"][variant] = {"skipped": f"--budget-s {a.budget_s} spent"}
            continue
        fused = variant.startswith("meshkit")
        backend = ("eager" if cpu else "inductor") if variant.endswith("compile") else None
        try:
            rows = [time_steps(cfg_of(n), device=device, dtype=dtype, batch=batch, seq=seq, steps=steps,
                               warmup=a.warmup, fused=fused, compile_backend=backend, fastest=cpu) for n in depths]
            out["variants"][variant] = {"compile_backend": backend, "rows": rows,
                                        **fit_and_mfu(rows, cfg_of, tokens=batch * seq, seq=seq, peak=peak.flops)}
        except Exception as exc:  # noqa: BLE001 - one variant's failure (OOM, compile) is a figure too
            out["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            if device == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps({variant: {k: v for k, v in out["variants"][variant].items() if k != "rows"}},
                         default=str), flush=True)
        if a.json:  # after every variant: a run killed at its time limit keeps the variants it finished
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
    return 1 if all("error" in v for v in out["variants"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
