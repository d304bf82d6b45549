"""``meshkit.Doctor``: a Lightning callback that checks a run for the failures that raise no error.

At setup it checks the layout against the node map and the preset (``tp_across_nodes``,
``preset_fallback``) and reads the previous run in the same log directory; after the first
step the FSDP units, the pipeline micro-batches, the dp overlap condition, the global batch and
unused parameters; during the first ``probe_steps`` steps each rank times a tiny probe collective
(at batch start and before backward: the last rank to arrive waits least) and hashes its first
``hash_batches`` batches. At train end rank 0 gathers all that (one collective) and adds the
cross-rank checks (``identical_batches``, ``straggler``), the pipeline timeline (``pp_unbalanced``),
CUDA profiler traces (``zero3_exposed_allgather``) and MFUMonitor's MFU (``mfu_band``); at fit end
TritonKernelReport's kernels (``low_occupancy``; put Doctor after it in ``callbacks``). Rank 0
writes ``<log_dir>/doctor.json``, a markdown table to TensorBoard's text tab, and prints the findings once.
``Doctor(mfu=True)`` also switches MFUMonitor on (one callback for both); the measuring side knows nothing
of the Doctor (profiling/ imports nothing above it).

Example::

    >>> import lightning as L, meshkit
    >>> trainer = L.Trainer(callbacks=[meshkit.Doctor(mfu=True)], max_steps=10)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import re
import statistics
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from meshkit.doctor import checks
from meshkit.doctor.findings import REPORT_FILE, Finding, findings_markdown, format_findings, merge_ranks, \
    read_report, write_report
from meshkit.profiling.mfu import MFUMonitor, batch_tokens, sequence_shards
from meshkit.quiet import quiet_lightning_pytree

__all__ = ["Doctor", "previous_run", "traces_findings", "with_traces", "fsdp_units"]


class Doctor(Callback):
    """Check a run for the failures that never raise an error; see the module docstring.

    Args:
        hash_batches: how many first batches each rank hashes for ``identical_batches``.
        probe_steps: steps (after ``warmup_steps``) whose probe waits feed ``straggler``; 0 turns it off.
        warmup_steps: first steps left out of timing.
        log_dir: where ``doctor.json`` goes (default: the trainer's ``log_dir``).
        print_report: print the findings on rank 0 at fit end.
        mfu: also measure MFU (``mfu_band``): ``True`` adds ``MFUMonitor()`` unless the Trainer has one; an
            ``MFUMonitor(...)`` is added as configured. Either goes just before the Doctor in ``callbacks``
            (it must finish its steps first) and is set up at once.

    After ``fit``, rank 0's ``doctor.findings`` holds the list (other ranks: what they saw themselves).
    """

    def __init__(self, *, hash_batches: int = 2, probe_steps: int = 20, warmup_steps: int = 1,
                 log_dir: str | None = None, print_report: bool = True,
                 mfu: bool | MFUMonitor = False) -> None:
        for name, value in (("hash_batches", hash_batches), ("probe_steps", probe_steps),
                            ("warmup_steps", warmup_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Doctor: `{name}={value!r}` must be an int >= 0.")
        if not isinstance(mfu, (bool, MFUMonitor)):
            raise ValueError(f"Doctor: `mfu={mfu!r}` must be True, False or an `MFUMonitor(...)`.")
        self.hash_batches, self.probe_steps, self.warmup_steps = hash_batches, probe_steps, warmup_steps
        self.log_dir, self.print_report, self.mfu = log_dir, print_report, mfu
        self._resetup: Any = None  # the trainer whose hook loop visits this Doctor's setup once more
        self.findings: list[Finding] = []
        self.run: dict[str, Any] = {}
        self._active = False

    # ------------------------------------------------------------------ setup: layout
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        quiet_lightning_pytree()  # Lightning's own LeafSpec warning, also in a one-device run (meshkit.quiet)
        if stage != "fit":
            return
        if self._resetup is trainer:  # the hook loop again, after _add_monitor put one before us
            self._resetup = None
            return
        if self.mfu is not False:
            self._add_monitor(trainer, pl_module, stage)
        self._active = True
        self.findings, self._local = [], []
        self._hashes: list[str] = []
        self._waits: list[float] = []
        self._step_ms: list[float] = []
        self._batches, self._wait, self._t0, self._first_done, self._grads_done = 0, 0.0, 0.0, False, False
        self._rank, self._world = trainer.global_rank, trainer.world_size
        self._log_dir = self.log_dir or trainer.log_dir or trainer.default_root_dir
        self._previous = previous_run(self._log_dir)
        self._dist = dist.is_available() and dist.is_initialized() and self._world > 1
        self._probe_group = None
        node = int(getattr(trainer, "node_rank", 0))
        self._node_of = [node]
        if self._dist:
            nodes: list[Any] = [None] * self._world
            dist.all_gather_object(nodes, node)
            self._node_of = [int(n) for n in nodes]
            if dist.get_backend() != "gloo":  # a host-side probe must not drain the device queue
                self._probe_group = _gloo_probe_group()
        self._dims = _parallel_dims(trainer.strategy)
        if self._dims is not None:
            self._grid = checks.rank_grid(self._dims.degrees, self._dims.order)
            self._order = tuple(self._dims.order)
            if len(self._node_of) == self._world:
                self._add(checks.tp_across_nodes(self._grid, self._order, self._node_of))
            preset = getattr(trainer.strategy, "preset", None)
            if preset is not None:
                self._local.extend(checks.preset_fallback(preset, self._dims.degrees, trainer.num_nodes, self._world))
        else:  # plain data parallel: every rank its own replica
            self._grid, self._order = checks.rank_grid({"dp_shard": self._world}, ("dp_shard",)), ("dp_shard",)

    def _add_monitor(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """``mfu=``: the MFUMonitor goes just before this Doctor (its last step is read at train end, before
        the Doctor's), set up now, on every rank. Lightning's hook loop walks ``trainer.callbacks`` itself,
        so it reaches this Doctor's ``setup`` once more: that call returns at once (``_resetup``)."""
        present = [cb for cb in trainer.callbacks if isinstance(cb, MFUMonitor)]
        if self.mfu is True and present or self.mfu in present:
            return
        if present:
            raise ValueError(
                "Doctor: `mfu=` passes an MFUMonitor but the Trainer's callbacks hold another one: pass "
                "`mfu=True` to use the Trainer's, or remove one of them."
            )
        monitor = MFUMonitor() if self.mfu is True else self.mfu
        trainer.callbacks.insert(trainer.callbacks.index(self), monitor)
        monitor.setup(trainer, pl_module, stage)
        self._resetup = trainer

    def _add(self, finding: Finding | None) -> None:
        if finding is not None:
            self._local.append(finding)

    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._resetup = None  # after setup's loop in any case: a loop that did not come back leaves nothing

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._active or self._dims is None:
            return
        self._add(checks.one_fsdp_unit(fsdp_units(trainer.strategy.model or pl_module), self._dims.fsdp_enabled))

    # ------------------------------------------------------------------ per step
    def _probing(self) -> bool:
        return self._dist and self.warmup_steps <= self._batches < self.warmup_steps + self.probe_steps

    def _probe(self) -> None:
        """A one-element all-reduce: how long this rank waits in it is how early it arrived."""
        t = time.perf_counter()
        dist.all_reduce(torch.zeros(1), group=self._probe_group)
        self._wait += 1e3 * (time.perf_counter() - t)

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._active:
            return
        if len(self._hashes) < self.hash_batches:
            self._hashes.append(_batch_hash(batch))
        self._wait = 0.0
        if self._probing():
            self._probe()
        self._t0 = time.perf_counter()

    @override
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._active and self._probing():
            self._probe()

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._active or self._grads_done:
            return
        self._grads_done = True  # after the first backward: every trainable parameter has a gradient
        unused = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad and p.grad is None]
        self._add(checks.unused_parameters([n for n, _ in unused], sum(p.numel() for _, p in unused), self._rank))

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._active:
            return
        step_ms = 1e3 * (time.perf_counter() - self._t0)
        if self._probing():
            self._waits.append(self._wait)
            self._step_ms.append(step_ms)
        self._batches += 1
        if not self._first_done:
            self._first_done = True
            self._first_step(trainer, batch)

    def _first_step(self, trainer: Any, batch: Any) -> None:
        """Batch arithmetic, once the first batch's size is known."""
        local = _batch_size(batch)
        accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        dp = self._dims.dp_size if self._dims is not None else self._world
        lr = None
        if trainer.optimizers and trainer.optimizers[0].param_groups:
            lr = trainer.optimizers[0].param_groups[0].get("lr")
        self.run = {"global_batch": local * dp * accumulate if local else None, "lr": lr,
                    "log_dir": os.path.abspath(self._log_dir), "world_size": self._world,
                    "degrees": dict(self._dims.degrees) if self._dims is not None else None}
        if self._previous:
            self._add(checks.global_batch_changed(self._previous, self.run))
        pipe = getattr(trainer.strategy, "_pipeline", None)
        if self._dims is not None and self._dims.pp_enabled and pipe is not None and local:
            from meshkit.plugins.pipeline import resolve_microbatches
            from meshkit.schedules import canonical_schedule, resolve_virtual_stages

            name = canonical_schedule(pipe.schedule)
            m = resolve_microbatches(name, self._dims.pp, local, pipe.microbatches, pipe.virtual_stages)
            self._add(checks.few_microbatches(name, self._dims.pp, m, resolve_virtual_stages(name, pipe.virtual_stages)))
        try:
            # a cp rank's batch holds T/cp of each sequence; the data-parallel replica processes all of it
            tokens = batch_tokens(batch) * accumulate * sequence_shards(trainer.strategy)
        except ValueError:
            return
        self._add(self._dp_overlap(trainer, tokens, dp))

    def _dp_overlap(self, trainer: Any, tokens: int, dp: int) -> Finding | None:
        from meshkit.hardware import find_gpu, normalize_dtype
        from meshkit.profiling.flops import peak_info

        device = trainer.strategy.root_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        row = find_gpu(name, has=("inter_bw_gbs",))
        if row is None or dp < 2:
            return None
        try:
            peak = peak_info(name, normalize_dtype(str(getattr(trainer, "precision", "32-true"))))
        except ValueError:
            return None
        dp_groups = checks.axis_groups(self._grid, self._order, [a for a in ("dp_replicate", "dp_shard")
                                                                 if a in self._order])
        crosses = any(len({self._node_of[r] for r in g}) > 1 for g in dp_groups) if len(self._node_of) > 1 else False
        link, bw = ("inter-node", row.inter_bw_gbs) if crosses else ("intra-node", row.intra_bw_gbs)
        return checks.dp_overlap(tokens, peak.flops, float(bw), dp, link, measured_peak=peak.kind == "measured",
                                 gpu=row.key)

    # ------------------------------------------------------------------ end: gather, cross-rank checks
    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._active:
            return
        mine = {"findings": [f.to_dict() for f in self._local], "hashes": self._hashes, "waits": self._waits,
                "step_ms": self._step_ms}
        everyone = [mine]
        if self._dist:
            everyone = [None] * self._world
            dist.all_gather_object(everyone, mine)
        if self._rank != 0:
            self.findings = list(self._local)
            return
        found = merge_ranks([[Finding.from_dict(d) for d in p["findings"]] for p in everyone])
        found.extend(self._cross_rank(everyone))
        files, traced = self._from_files(trainer)
        found = with_traces(found, files, traced)
        found.extend(_mfu_findings(trainer))
        self.findings = merge_ranks([found])
        write_report(self._log_dir, self.findings, self.run)

    def _cross_rank(self, everyone: list[dict]) -> list[Finding]:
        out = []
        if len(everyone) > 1:
            hashes = {r: p["hashes"] for r, p in enumerate(everyone)}
            data_axes = [a for a in ("dp_replicate", "dp_shard") if a in self._order]
            f = checks.identical_batches(hashes, checks.axis_groups(self._grid, self._order, data_axes))
            out.append(f) if f else None
            steps = [s for p in everyone for s in p["step_ms"]]
            if steps:
                f = checks.straggler({r: p["waits"] for r, p in enumerate(everyone)}, statistics.median(steps))
                out.append(f) if f else None
        return out

    def _from_files(self, trainer: Any) -> tuple[list[Finding], bool]:
        """pp_unbalanced from the pipeline timeline; zero3_exposed_allgather and the straggler from the profiler
        traces; and whether there were readable traces."""
        out: list[Finding] = []
        from meshkit.timeline import find_timeline_dir, read_timeline

        pipe = getattr(trainer.strategy, "_pipeline", None)
        tdir = getattr(pipe, "timeline_dir", None) or find_timeline_dir(self._log_dir)
        if tdir and os.path.isdir(tdir):
            try:
                f = checks.pp_unbalanced(read_timeline(tdir), skip_steps=self.warmup_steps)
                out.append(f) if f else None
            except ValueError:
                pass
        from meshkit.profiling.trace import find_trace_files

        trace_dir = os.path.join(self._log_dir, "profiler")
        traced = traces_findings(trace_dir)
        readable = os.path.isdir(trace_dir) and bool(find_trace_files(trace_dir)) and not any(
            f.id == "unreadable_trace" for f in traced)
        return out + traced, readable

    # ------------------------------------------------------------------ fit end: kernels, report
    @override
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._active or self._rank != 0:
            self._active = False
            return
        self._active = False
        reports = [r for cb in trainer.callbacks for r in (getattr(cb, "reports", None) or [])
                   if hasattr(r, "occupancy")]
        if reports:
            self.findings = merge_ranks([self.findings + checks.low_occupancy(reports)])
            write_report(self._log_dir, self.findings, self.run)
        writer = next((lg.experiment for lg in trainer.loggers
                       if hasattr(getattr(lg, "experiment", None), "add_text")), None)
        if writer is not None:
            writer.add_text("meshkit/doctor", findings_markdown(self.findings), global_step=0)
            writer.flush()
        if self.print_report:
            print(format_findings(self.findings), flush=True)


# --------------------------------------------------------------------------------- helpers


def traces_findings(trace_dir: str) -> list[Finding]:
    """zero3_exposed_allgather and the straggler (:func:`~meshkit.doctor.checks.traced_straggler`: the rank
    ``meshkit analyze`` names) from the torch.profiler traces under ``trace_dir`` (none if there are none)."""
    from meshkit.profiling.overlap import analyze
    from meshkit.profiling.trace import find_trace_files, load_windows

    if not os.path.isdir(trace_dir) or not find_trace_files(trace_dir):
        return []
    try:
        windows, _ = load_windows(trace_dir)
    except ValueError as exc:  # e.g. a rank's trace with no usable events: say so, do not report "no findings"
        return [Finding("unreadable_trace", "warning", None, {"trace_dir": trace_dir, "error": str(exc)},
                        f"`meshkit analyze {trace_dir}` shows the same error; re-profile, or remove the damaged file.")]
    worst: dict[int, Finding] = {}  # per rank, the window where the most all-gather time was exposed
    for window in windows:
        for f in checks.zero3_exposed_allgather(window.ranks):
            if f.rank not in worst or f.evidence["fraction"] > worst[f.rank].evidence["fraction"]:
                worst[f.rank] = f
    out = [worst[r] for r in sorted(worst)]
    try:
        f = checks.traced_straggler(analyze(trace_dir))
    except ValueError:
        return out
    return out + ([f] if f else [])


def with_traces(found: list[Finding], from_traces: list[Finding], traced: bool) -> list[Finding]:
    """``found`` (the probe's findings among them) and the traces' findings; with readable traces the probe's
    ``straggler`` gives way to theirs (:func:`~meshkit.doctor.checks.traced_straggler`, the rank ``meshkit
    analyze`` names), present or not: the probe cannot tell a slow rank from one that waited for it."""
    kept = [f for f in found if not (traced and f.id == "straggler")]
    return kept + list(from_traces)


def _mfu_findings(trainer: Any) -> list[Finding]:
    """mfu_band from a callback that keeps MFUMonitor's ``history`` (StepMetrics) and ``peak_source``."""
    for cb in trainer.callbacks:
        history = getattr(cb, "history", None)
        source = getattr(cb, "peak_source", None)
        if history and isinstance(source, str):
            mfus = sorted(m.mfu for m in history)
            kind = source.split(":", 1)[0] if ":" in source else source
            return [checks.mfu_band(mfus[len(mfus) // 2], kind, source)]
    return []


_VERSION = re.compile(r"^version_(\d+)$")


def previous_run(log_dir: str) -> dict[str, Any]:
    """The ``run`` record of the previous run in the same log directory: ``<log_dir>/doctor.json`` itself
    (a reused directory), else the highest earlier ``version_N`` sibling's (TensorBoardLogger's layout)."""
    candidates = [os.path.join(log_dir, REPORT_FILE)]
    parent, base = os.path.split(os.path.normpath(log_dir))
    m = _VERSION.match(base)
    if m and os.path.isdir(parent):
        earlier = sorted((int(v.group(1)), d) for d in os.listdir(parent)
                         if (v := _VERSION.match(d)) and int(v.group(1)) < int(m.group(1)))
        candidates += [os.path.join(parent, d, REPORT_FILE) for _, d in reversed(earlier)]
    for path in candidates:
        if os.path.isfile(path):
            try:
                return read_report(path)[1]
            except ValueError:
                continue
    return {}


def fsdp_units(model: torch.nn.Module) -> list[checks.FsdpUnit]:
    """Each FSDP unit of ``model`` and what its own parameters are (see :class:`checks.FsdpUnit`), counted
    unsharded; a parameter held by several modules (a tied embedding and LM head) counts once, in the first
    module that holds it (the embedding, which comes first in HF and torchtitan models)."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    block_of: dict[int, str] = {}  # module id -> the block stack entry holding it ("model.layers.0")
    for name, stack in model.named_modules():
        entries = list(stack.named_children()) if isinstance(stack, (nn.ModuleList, nn.ModuleDict)) else []
        # one class (fully_shard swaps an entry's class for FSDP<class>: compare the class under it)
        if entries and len({next(k for k in type(c).__mro__ if not issubclass(k, FSDPModule)) for _, c in entries}) == 1:
            for n, entry in entries:
                for sub in entry.modules():
                    block_of.setdefault(id(sub), f"{name}.{n}" if name else n)
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    units: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()

    def walk(module: torch.nn.Module, path: str, owner: str | None) -> None:
        owner = path if isinstance(module, FSDPModule) else owner
        for p in module.parameters(recurse=False):
            if owner is None or id(p) in seen:
                continue
            seen.add(id(p))
            u = units.setdefault(owner, {"parameters": 0, "embeddings": 0, "lm_head": 0, "block_parameters": 0,
                                         "blocks": set(), "tied": 0})
            n = p.numel()  # a DTensor's numel is the full (unsharded) size
            u["parameters"] += n
            u["tied"] += n if holders[id(p)] > 1 else 0
            if id(module) in block_of:
                u["block_parameters"] += n
                u["blocks"].add(block_of[id(module)])
            elif isinstance(module, nn.Embedding):
                u["embeddings"] += n
            elif isinstance(module, nn.Linear) and module.out_features in vocab:
                u["lm_head"] += n
        for name, child in module.named_children():
            walk(child, f"{path}.{name}" if path else name, owner)

    walk(model, "", None)
    return [checks.FsdpUnit(name, **{**u, "blocks": len(u["blocks"])}) for name, u in units.items()]


def _parallel_dims(strategy: Any) -> Any:
    try:
        dims = getattr(strategy, "parallel_dims", None)
    except RuntimeError:  # not resolved yet
        return None
    return dims if hasattr(dims, "degrees") and hasattr(dims, "order") else None


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for k in sorted(batch, key=str) for t in _tensors(batch[k])]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in _tensors(b)]
    return []


def _batch_hash(batch: Any) -> str:
    h = hashlib.sha1()
    for t in _tensors(batch):
        t = t.detach().to("cpu").contiguous()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _batch_size(batch: Any) -> int | None:
    ts = _tensors(batch)
    return int(ts[0].shape[0]) if ts and ts[0].dim() >= 1 else None


_PROBE: list[Any] = [None, None]  # (weak reference to the default group, the gloo group made on it)


def _gloo_probe_group() -> Any:
    """One gloo group over all ranks per default group (a collective the first time): a process that runs
    many fits does not add a group, and its threads, per fit."""
    ref, group = _PROBE
    if ref is None or ref() is not dist.group.WORLD:
        group = dist.new_group(backend="gloo")
        _PROBE[:] = [weakref.ref(dist.group.WORLD), group]
    return group
