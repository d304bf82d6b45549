"""Conformance sweep: every causal-LM family the installed transformers registers, 4 presets against one process.

    python benchmarks/family_sweep.py                          # every family (long: minutes per family on 2 cores)
    python benchmarks/family_sweep.py --families llama,cohere  # a subset
    python benchmarks/family_sweep.py --families llama --results sweep.json   # cells merged into sweep.json
    python benchmarks/family_sweep.py --families "" --results sweep.json --write-docs   # its table -> docs/models.md

Each family gets its tiny twin config (:func:`meshkit.families.tiny_config`: 2 layers of tiny width, the test
vocabulary; sdpa, or where the class has none transformers' own eager attention; MoE experts their own per-expert
loop) through ``tests/distributed/hf_models.py`` (``"auto:<model_type>"``), and each preset
(fsdp2, hsdp_tp, cp, tp_pp) trains it on a 4-process gloo pool (``tests/dist_pool.ProcessPool``) in float64
(the family's own float32 steps too: ``hf_models.Float64Math``) for
``--steps`` steps, against the same model, seed and batches in one process, as ``tests/distributed/test_model_matrix.py``
compares: losses at rtol 1e-6, every parameter's update error max|dist-ref| / max|ref-init| at most 1e-6.

A cell is one of:

- ``exact (e)``: losses and every parameter match; ``e`` is the worst update error;
- ``refused, fix exact (e)``: meshkit refused before training with a fix it names (a ``tp_plan``, a config change,
  untying), and the sweep applied that fix and the run with it is exact;
- ``refused: ...``: refused with a fix the sweep cannot apply by itself (a ``pipeline_stage_forward`` hook, a
  model that is no layer stack for pp); the message's first words are kept;
- ``skipped: ...``: the family does not build as a tiny causal LM here, or has no float64 forward on CPU;
- ``batch-dependent (e; one-process floor f)``: the family's own training step changes when a batch is split
  (one process, the same steps with each batch in two halves: floor f above the limit, PhiMoE's router 1e0), so no
  data-parallel run can equal one process; a MISMATCH cell of such a row is this, not a layout's fault;
- ``MISMATCH (e)`` (a silent cell: trained, but not the same computation; ``refused, fix MISMATCH`` after the
  fix a refusal named) or ``raw error: ...`` (a failure that is
  no meshkit refusal): the sweep's findings; the issue's goal is none of either.

The table goes into docs/models.md between the sweep markers, with the transformers version and the runtime.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.dist_pool import ProcessPool  # noqa: E402
from tests.distributed import hf_models as H  # noqa: E402
from tests.distributed import training as T  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    "fsdp2": dict(dp_shard=4, tp=1),
    "hsdp_tp": dict(dp_shard=2, tp=2),
    "cp": dict(dp_shard=2, cp=2, tp=1),
    "tp_pp": dict(dp_shard=1, pp=2, tp=2, pp_schedule="1f1b"),
}
MAX_UPDATE_ERROR = 1e-6
MAX_LOSS_RTOL = 1e-6
UNTIED = {"tie_word_embeddings": False}
BEGIN, END = "<!-- family-sweep:begin -->", "<!-- family-sweep:end -->"
DOCS = ROOT / "docs" / "models.md"


def registered_families() -> list[str]:
    """The model types of transformers' causal-LM auto mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _first_words(text: str, n: int = 14) -> str:
    return " ".join(str(text).replace("|", "/").split()[:n])


def _refusal(text: str) -> str | None:
    """The meshkit refusal inside an error text (a pool failure carries every rank's traceback), if any."""
    found = re.search(r"ValueError: ((?:pipeline|apply_context_parallel|context_parallel_attention|NDParallelStrategy|"
                      r"tensor_parallel|tp_plan|infer_tp_plan|parallelize|ParallelDims)[^\n]*)", text)
    if found:
        return found.group(1)
    found = re.search(r"ValueError: ([^\n]*(cannot place these projections|tp_plan=)[^\n]*)", text)
    return found.group(1) if found else None


def _fix_of(refusal: str) -> tuple[dict, dict] | None:
    """(strategy changes, config overrides) of the fix a refusal names, where the sweep can apply it."""
    if re.search(r"tp_plan=\{[^}]*\}\)", refusal):
        return {"tp_plan": H.suggested_plan(refusal)}, {}
    if "tie_word_embeddings=False" in refusal:
        return {}, dict(UNTIED)
    if re.search(r"`config\.\w+ ?=", refusal):
        return {}, H.suggested_config(refusal)
    return None


MAX_TINY_PARAMS = 50_000_000
"""A tiny twin above this many parameters is skipped: its config has parts tiny_config does not shrink (a
multimodal family's towers: phi4_multimodal's twin holds 870 M in `embed_tokens_extend`), and its 4-rank cells
ran past the cell timeout (the twins of the text families hold 20-200 k; Inkling2's, with a head tiny_config
does not shrink, 7 M, and trains in about a minute a cell)."""


def _largest_child(module: torch.nn.Module) -> tuple[str, int]:
    """(dotted name, parameters) of the deepest submodule holding 90 % or more of ``module``'s parameters."""
    name, total = "", sum(p.numel() for p in module.parameters())
    while True:
        sizes = [(n, m, sum(p.numel() for p in m.parameters())) for n, m in module.named_children()]
        child = max(sizes, key=lambda item: item[2], default=None)
        if child is None or child[2] < 0.9 * total:
            return name, total
        name, module, total = f"{name}.{child[0]}".lstrip("."), child[1], child[2]


def one_process_check(family: str) -> str | None:
    """Why ``family`` is skipped (None: it builds and runs a float64 forward and backward in one process)."""
    try:
        module = H.build(family)
    except Exception as e:  # noqa: BLE001 -- any reason a family does not build is a skip reason
        return f"skipped: tiny config does not build ({type(e).__name__}: {_first_words(e, 10)})"
    size = sum(p.numel() for p in module.parameters())
    if size > MAX_TINY_PARAMS:
        part, held = _largest_child(module)
        return (f"skipped: its tiny config is not tiny ({size / 1e6:.0f} M parameters, {held / 1e6:.0f} M in "
                f"`{part}`: parts tiny_config does not shrink)")
    try:
        with H.float64_math():
            module.loss(T.tokens(2)).backward()
    except Exception as e:  # noqa: BLE001
        return f"skipped: its one-process float64 forward/backward fails on CPU ({type(e).__name__}: {_first_words(e, 10)})"
    return None


def _compare(family: str, results: list[dict], overrides: dict, steps: int) -> tuple[bool, float]:
    want_losses, init, want = H.reference(family, steps, results[0]["dp_size"], overrides=overrides)
    got = torch.tensor(T.global_losses(results), dtype=torch.float64)
    ref = torch.tensor(want_losses, dtype=torch.float64)
    losses_ok = bool(((got - ref).abs() <= MAX_LOSS_RTOL * ref.abs()).all())
    errors = H.update_errors(H.merged_params(results), init, want)
    worst = max(errors.values())
    return losses_ok and worst <= MAX_UPDATE_ERROR, worst


CELL_TIMEOUT_S = 240.0
"""How long one fit of a cell may take on the pool (``--cell-timeout``): past it the cell is a raw error
("TimeoutError"), a time-out on a slow or loaded host, not a verdict: rerun that family alone with more."""


def run_cell(pool: ProcessPool, family: str, preset: str, steps: int, timeout: float = CELL_TIMEOUT_S) -> str:
    """One cell's verdict (see the module docstring)."""
    strategy, overrides, fixed = dict(PRESETS[preset]), {}, False
    for attempt in range(3):  # the run, then up to two fixes (e.g. untie for pp, then a tp_plan)
        try:
            results = pool.run(H.fit, family, strategy, steps, "ce", overrides or None, timeout=timeout)
        except Exception as e:  # noqa: BLE001 -- classify every failure
            text = f"{type(e).__name__}: {e}"
            refusal = _refusal(text)
            if refusal is None:
                return f"raw error: {_first_words(text.splitlines()[-1] if text.splitlines() else text)}"
            fix = _fix_of(refusal)
            if fix is None or attempt == 2:  # the model's own reason, not the strategy's wrapper around it
                return f"refused: {_first_words(refusal.split(' model: ', 1)[-1])}"
            strategy.update(fix[0])
            overrides.update(fix[1])
            fixed = True
            continue
        ok, worst = _compare(family, results, overrides, steps)
        if not ok:
            return f"refused, fix MISMATCH ({worst:.0e})" if fixed else f"MISMATCH ({worst:.0e})"
        return f"refused, fix exact ({worst:.0e})" if fixed else f"exact ({worst:.0e})"
    return "raw error: no verdict"


def sweep(
    families: list[str], presets: list[str], steps: int, pool: ProcessPool | None = None, log: Any = print,
    on_row: Any = None, timeout: float = CELL_TIMEOUT_S,
) -> dict[str, dict[str, str]]:
    """{model_type: {preset: verdict}} for ``families`` (model types, without the ``auto:`` prefix), on ``pool``
    (a 4-process :class:`ProcessPool`; one is started when None); ``on_row(model_type, row, seconds)`` after each."""
    if pool is None:
        with ProcessPool(world_size=4) as own:
            return sweep(families, presets, steps, own, log, on_row, timeout)
    table: dict[str, dict[str, str]] = {}
    for model_type in families:
        family = H.AUTO + model_type
        t0 = time.perf_counter()
        skip = one_process_check(family)
        table[model_type] = {p: skip or run_cell(pool, family, p, steps, timeout) for p in presets}
        if any("MISMATCH" in cell for cell in table[model_type].values()):
            table[model_type] = against_floor(table[model_type], H.noise_floor(family, steps, dp=2))
        seconds = time.perf_counter() - t0
        log(f"{model_type:28s} {seconds:6.1f}s  " + " | ".join(table[model_type].values()), flush=True)
        if on_row is not None:
            on_row(model_type, table[model_type], seconds)
    return table


FLOOR_ABOVE = 1e-12
"""A row whose exact cells reach above this gets its one-process floor measured (``--floors``)."""


def worst_exact(row: dict[str, str]) -> float:
    """The largest update error among a row's exact cells ("exact", "refused, fix exact"); 0 with none."""
    found = [float(m.group(1)) for c in row.values() if "exact (" in c and "MISMATCH" not in c
             for m in [re.search(r"exact \(([0-9.e+-]+)\)", c)] if m]
    return max(found, default=0.0)


def floors(table: dict[str, dict[str, str]], known: dict[str, float], steps: int, log: Any = print) -> dict[str, float]:
    """:func:`hf_models.noise_floor` of every row whose exact cells reach above :data:`FLOOR_ABOVE` or that has a
    MISMATCH (those already in ``known`` kept): the family's own rounding in one process, to read those cells
    against."""
    out = dict(known)
    for family, row in sorted(table.items()):
        mismatch = any("MISMATCH" in cell for cell in row.values())
        if family not in out and (worst_exact(row) > FLOOR_ABOVE or mismatch):
            out[family] = H.noise_floor(H.AUTO + family, steps, dp=2)  # both runs under Float64Math
            log(f"{family:28s} floor {out[family]:.0e} (cells up to {worst_exact(row):.0e})", flush=True)
    return out


def against_floor(row: dict[str, str], floor: float) -> dict[str, str]:
    """``row`` with its MISMATCH cells read against the family's one-process floor: above the limit, the family's
    training step changes when a batch is split, and those cells are ``batch-dependent``; else unchanged."""
    if floor <= MAX_UPDATE_ERROR:
        return dict(row)
    found = {p: re.search(r"MISMATCH \(([^)]*)\)", c) for p, c in row.items()}
    return {p: f"batch-dependent ({m.group(1)}; one-process floor {floor:.0e})" if m else row[p]
            for p, m in found.items()}


def summary(table: dict[str, dict[str, str]]) -> dict[str, int]:
    counts = {"exact": 0, "refused, fix exact": 0, "refused, fix MISMATCH": 0, "refused": 0, "skipped": 0,
              "batch-dependent": 0, "MISMATCH": 0, "raw error": 0}
    for row in table.values():
        for cell in row.values():
            key = next(k for k in sorted(counts, key=len, reverse=True) if cell.startswith(k))
            counts[key] += 1
    return counts


def markdown(table: dict[str, dict[str, str]], meta: dict[str, Any], floor: dict[str, float] | None = None) -> str:
    counts = summary(table)
    floor = floor or {}
    lines = [
        BEGIN,
        f"Swept with transformers {meta['transformers']}, torch {meta['torch']}, {meta['steps']} steps, "
        f"{len(table)} of the {meta['registered']} registered causal-LM families, in {meta['seconds']:.0f} s "
        f"(`python benchmarks/family_sweep.py`). Cells: "
        + ", ".join(f"{v} {k}" for k, v in counts.items()) + ".",
        "",
        "The last column is the family's own rounding floor in one process (`--floors`: the same steps with each "
        "batch summed in two halves), measured where a row's exact cells reach above "
        f"{FLOOR_ABOVE:.0e}; a cell near its floor is exact, a wrong layout is off by 1e-2 or more.",
        "",
        "| family | " + " | ".join(PRESETS) + " | one-process floor |",
        "|---|" + "---|" * (len(PRESETS) + 1),
    ]
    for family in sorted(table):
        cells = [table[family].get(p, "not run") for p in PRESETS]
        measured = f"{floor[family]:.0e}" if family in floor else ""
        lines.append(f"| {family} | " + " | ".join(cells) + f" | {measured} |")
    lines.append(END)
    return "\n".join(lines)


def write_docs(table: dict[str, dict[str, str]], meta: dict[str, Any], path: Path = DOCS,
               floor: dict[str, float] | None = None) -> None:
    text = path.read_text()
    block = markdown(table, meta, floor)
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## Every registered family (the conformance sweep)\n\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: every registered one)")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT_S, help="seconds one cell's fit may take")
    parser.add_argument("--results", type=Path, help="JSON file to merge this run's cells into (kept across runs)")
    parser.add_argument("--write-docs", action="store_true", help="write the (merged) table into docs/models.md")
    parser.add_argument("--floors", action="store_true",
                        help=f"measure the one-process floor of rows with exact cells above {FLOOR_ABOVE:.0e}")
    args = parser.parse_args(argv)
    families = registered_families() if args.families is None else [f for f in args.families.split(",") if f]
    merged: dict[str, Any] = {"table": {}, "seconds": 0.0}
    if args.results and args.results.exists():
        merged = json.loads(args.results.read_text())

    def keep(model_type: str, row: dict[str, str], seconds: float) -> None:  # after every family: a cut run keeps it
        merged["table"].setdefault(model_type, {}).update(row)  # a run of some presets keeps the others' cells
        merged["seconds"] += seconds
        if args.results:
            args.results.write_text(json.dumps(merged, indent=1, sort_keys=True))

    if families:
        sweep(families, args.presets.split(","), args.steps, on_row=keep, timeout=args.cell_timeout)
    meta = dict(transformers=transformers.__version__, torch=torch.__version__, steps=args.steps,
                registered=len(registered_families()), seconds=merged["seconds"])
    if args.floors:
        merged["floors"] = floors(merged["table"], merged.get("floors", {}), args.steps)
        for family, floor in merged["floors"].items():  # rows swept before the floor was read with them
            merged["table"][family] = against_floor(merged["table"][family], floor)
        if args.results:
            args.results.write_text(json.dumps(merged, indent=1, sort_keys=True))
    print(summary(merged["table"]))
    if args.write_docs:
        write_docs(merged["table"], meta, floor=merged.get("floors"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
