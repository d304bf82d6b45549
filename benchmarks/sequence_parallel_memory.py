"""Sequence parallelism on a transformers Llama: activation memory per rank with ``sequence_parallel`` off and on.

For tp in ``--tp`` (gloo processes on CPU, tensor parallelism only, so parameters and their gradients are the
same in both columns), each rank runs one forward + backward of ``transformers.LlamaForCausalLM`` on one
sequence of ``--seq`` tokens under meshkit's TP plan, without and with ``sequence_parallel=True``, and reports:

- bytes the decoder layers save for backward (saved-tensor hooks while a layer runs, distinct storages,
  parameters excluded) per rank and per layer: the activation memory sequence parallelism is for, as a ratio
  to the same tp without SP (the named baseline), beside the ratio meshkit's planner predicts
  (``planner.model.activation_bytes_per_layer``, Korthikanti et al. 2022 eq. 3/4, no attention scores);
- bytes the whole model saves for backward (embedding output, logits and loss included);
- peak bytes allocated during the forward + backward, per rank (parameters and anything alive before the step
  excluded, gradients and communication buffers included): on CPU the largest "Total Allocated" of
  torch.profiler's allocation records, on GPUs the CUDA allocator's peak.

``--ac selective`` runs meshkit's selective activation checkpointing on the decoder layers (what it stores is
invisible to the saved-tensor hooks, so only the peak column means anything there).

Each setting runs ``--repeats`` times (default 3), SP off and on alternating which goes first, and every column
is reported as min..max over the repeats: the saved bytes are exact counts and repeat to the byte, the peak does
not. Its step comes from whether buffers freed late (e.g. the output layer's logits all-gather, 6 MiB at tp 2)
are still alive at the loss's backward, with SP on and off alike, so one run per setting can read a ratio of
1.135 that like against like is 0.93-0.94. The peak ratio is given min/min and max/max.

    python benchmarks/sequence_parallel_memory.py --seq 2048 --tp 2 4
    python benchmarks/sequence_parallel_memory.py --seq 2048 --tp 2 4 --ac selective
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(args: argparse.Namespace):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        tie_word_embeddings=False, attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    return config


def _storage(t: torch.Tensor) -> tuple[object, int]:
    """(key, bytes) of the storage behind ``t``: a DTensor's local tensor (its private ``_local_tensor``; to_local()
    inside a saved-tensor hook would record an autograd op) and a functional collective's wrapped result
    (``elem``), torch 2.13 checked; a tensor without a real storage counts its own bytes."""
    t = getattr(t, "_local_tensor", t)
    t = getattr(t, "elem", t)
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:
        return ("tensor", id(t)), t.numel() * t.element_size()


def measure(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from meshkit.plugins.activation_checkpoint import apply_ac
    from meshkit.plugins.tensor_parallel import apply_tp, infer_tp_plan

    device = torch.device(args.device, rank if args.device == "cuda" else 0) if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("tp",))
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    row: dict[str, list] = {"no_sp": [], "sp": []}
    for sp in [sp for r in range(args.repeats) for sp in ((False, True) if r % 2 == 0 else (True, False))]:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_config(args)).to(device)
        apply_tp(model, mesh, infer_tp_plan(model, sequence_parallel=sp))
        apply_ac([(f"model.layers.{i}", layer) for i, layer in enumerate(model.model.layers)], args.ac)
        params = {_storage(p)[0] for p in model.parameters()}
        seen: dict[object, int] = {}
        in_layer: dict[object, int] = {}
        depth = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            key, nbytes = _storage(t)
            if key not in params:
                seen[key] = nbytes
                if depth[0]:
                    in_layer[key] = nbytes
            return t

        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
            layer.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        row["sp" if sp else "no_sp"].append({
            "layer_bytes": sum(in_layer.values()) / args.layers, "model_bytes": sum(seen.values()),
            "peak_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else _cpu_peak(prof),
        })
        del model, loss
    if rank == 0:
        out[world] = row
    dist.destroy_process_group()


def _cpu_peak(prof: object) -> int:
    """Peak bytes allocated inside ``prof``'s window above what was allocated when it opened: the largest
    "Total Allocated" of its allocation records (the chrome trace's ``[memory]`` events, in time order)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            records = sorted((e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"),
                             key=lambda e: e["ts"])
    if not records:
        return 0
    start = records[0]["args"]["Total Allocated"] - records[0]["args"]["Bytes"]
    return max(r["args"]["Total Allocated"] for r in records) - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ac", choices=("none", "selective"), default="none")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting (min..max reported)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()

    from meshkit.planner.model import activation_bytes_per_layer

    results = mp.Manager().dict()
    for tp in args.tp:
        mp.spawn(measure, args=(tp, _free_port(), args, results), nprocs=tp)
    elem = 4  # float32 here; the planner counts 16-bit activations, so its bytes are doubled
    print(f"transformers Llama, hidden {args.hidden}, ffn {args.ffn}, {args.heads} heads ({args.kv_heads} kv), "
          f"{args.layers} layers, one sequence of {args.seq} tokens, float32, {args.device}")
    print(f"{'tp':>3} {'layer MiB SP off':>17} {'SP on':>8} {'ratio':>6} {'planner':>8} "
          f"{'model MiB SP off':>17} {'SP on':>8} {'ratio':>6}")
    rows = []
    mib = 2 ** 20

    def span(runs: list, key: str) -> tuple[float, float]:
        values = [run[key] for run in runs]
        return min(values), max(values)

    def text(lo_hi: tuple[float, float], scale: float = mib) -> str:
        lo, hi = lo_hi[0] / scale, lo_hi[1] / scale
        return f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f}..{hi:.2f}"

    for tp in args.tp:
        r = results[tp]
        plan = {sp: activation_bytes_per_layer(args.seq, 1, args.hidden, args.heads, tp, sequence_parallel=sp,
                                               attention_scores=False, ffn=args.ffn, kv_heads=args.kv_heads,
                                               checkpointing=args.ac, dropout=False) * elem / 2 for sp in (False, True)}
        off = {k: span(r["no_sp"], k) for k in ("layer_bytes", "model_bytes", "peak_bytes")}
        on = {k: span(r["sp"], k) for k in ("layer_bytes", "model_bytes", "peak_bytes")}
        row = {"tp": tp, "ac": args.ac, "repeats": args.repeats,
               "layer_bytes_off": off["layer_bytes"], "layer_bytes_on": on["layer_bytes"],
               "layer_ratio": on["layer_bytes"][0] / off["layer_bytes"][0], "planner_ratio": plan[True] / plan[False],
               "model_bytes_off": off["model_bytes"], "model_bytes_on": on["model_bytes"],
               "model_ratio": on["model_bytes"][0] / off["model_bytes"][0],
               "peak_off": off["peak_bytes"], "peak_on": on["peak_bytes"],
               "peak_ratio_min": on["peak_bytes"][0] / off["peak_bytes"][0],
               "peak_ratio_max": on["peak_bytes"][1] / off["peak_bytes"][1]}
        rows.append(row)
        print(f"{tp:>3} {text(off['layer_bytes']):>17} {text(on['layer_bytes']):>8} {row['layer_ratio']:>6.3f} "
              f"{row['planner_ratio']:>8.3f} {text(off['model_bytes']):>17} {text(on['model_bytes']):>8} "
              f"{row['model_ratio']:>6.3f}")
        print(f"    peak MiB a rank ({args.device}, ac {args.ac}, {args.repeats} runs each): SP off "
              f"{text(off['peak_bytes'])}, on {text(on['peak_bytes'])}, ratio min/min {row['peak_ratio_min']:.3f}, "
              f"max/max {row['peak_ratio_max']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
