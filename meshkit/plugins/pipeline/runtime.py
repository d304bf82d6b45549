"""Pipeline runtime: split a model into this rank's stages, wrap them in torch stages and a schedule,
run training steps and forward-only evaluation (see :mod:`meshkit.plugins.pipeline`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from meshkit.plugins.pipeline.schedule import (
    resolve_microbatches,
    resolve_virtual_stages,
    schedule_spec,
    stage_ids_on_rank,
    stage_rank,
)
from meshkit.plugins.pipeline.split import (
    LayerStack,
    balanced_split_points,
    build_stage_module,
    check_split_points,
    find_layer_stack,
    stack_costs,
)
from meshkit.schedules import canonical_schedule
from meshkit.timeline import TimelineRecorder

__all__ = [
    "Pipeline",
    "build_pipeline",
    "causal_lm_loss",
    "make_pipeline",
    "pipeline_eval",
    "pipeline_step",
    "plan_split",
    "split_model",
]


def causal_lm_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of logits (B, T, V) against labels (B, T): the default pipeline loss.

    Computed in float32 at least (bf16 logits are upcast; float64 ones stay float64).
    """
    logits = output.flatten(0, 1)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), labels.flatten(0, 1))


def plan_split(
    model: nn.Module, num_stages: int, split_points: list[int] | None = None, cost: str = "params"
) -> tuple[LayerStack, list[int]]:
    """The model's :class:`LayerStack` and the block indices where stages 1..S-1 start.

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> plan_split(Transformer(LlamaConfig.tiny(n_layers=8)), 4)[1]
    [2, 4, 6]
    """
    stack = find_layer_stack(model)
    n = len(stack.block_names)
    if num_stages > n:
        raise ValueError(
            f"pipeline: the model has {n} blocks (`{stack.blocks}`) but the pipeline needs {num_stages} stages "
            "(pp × pp_virtual_stages) of at least one block each. Lower pp or pp_virtual_stages, or use a deeper model."
        )
    if split_points is not None:
        return stack, check_split_points(split_points, n, num_stages)
    blocks, first, last = stack_costs(model, stack, cost)
    return stack, balanced_split_points(blocks, num_stages, first, last)


def split_model(
    model: nn.Module, stage_ids: tuple[int, ...], num_stages: int, split_points: list[int] | None = None,
    cost: str = "params",
) -> list[nn.Module]:
    """Stage modules for ``stage_ids`` (copies of ``model``; full-model FQNs), in the order given.

    Chaining all stages' outputs reproduces ``model``'s logits:

    >>> import torch
    >>> from meshkit.models import LlamaConfig, Transformer
    >>> model = Transformer(LlamaConfig.tiny())
    >>> stages = split_model(model, (0, 1), 2)
    >>> x = torch.randint(0, 256, (2, 8))
    >>> torch.allclose(stages[1](stages[0](x)), model(x), atol=1e-6)
    True
    """
    stack, points = plan_split(model, num_stages, split_points, cost)
    return [build_stage_module(model, stack, s, num_stages, points) for s in stage_ids]


@dataclass
class Pipeline:
    """This rank's share of a pipeline: its stage modules, torch stages and schedule."""

    schedule: Any
    """The torch schedule (``ScheduleGPipe``, ``ScheduleInterleaved1F1B``, ...)."""
    stages: list[PipelineStage]
    modules: list[nn.Module]
    """Stage modules on this rank, in the order of ``stage_ids``; full-model FQNs."""
    stage_ids: tuple[int, ...]
    num_stages: int
    split_points: list[int]
    microbatches: int
    schedule_name: str
    group: Any
    """The pipeline process group."""
    last_stage_rank: int
    """Rank (in ``group``) that holds the last stage: losses are broadcast from it."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    recorder: TimelineRecorder | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def parameters(self) -> Iterator[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Full-model FQNs (stages hold disjoint blocks; shared names cannot occur)."""
        for m in self.modules:
            yield from m.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under their full-model FQNs."""
        out: dict[str, torch.Tensor] = {}
        for m in self.modules:
            out.update(m.state_dict())
        return out


def build_pipeline(
    model: nn.Module,
    pp_mesh: Any,
    *,
    schedule: str = "1f1b",
    batch_size: int,
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    split_points: list[int] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = causal_lm_loss,
    cost: str = "params",
    device: torch.device | str | None = None,
    timeline_dir: str | os.PathLike | None = None,
    stage_transform: Callable[[nn.Module, int], nn.Module] | None = None,
) -> Pipeline:
    """Split ``model`` into this rank's stages and build the ``schedule`` over them.

    Args:
        model: a layer-stack model (see :func:`find_layer_stack`); it is copied, not changed.
        pp_mesh: the 1-D "pp" DeviceMesh (``parallel_dims.submesh("pp")``) or a ProcessGroup.
        schedule: a name of :data:`~meshkit.plugins.pipeline.SCHEDULES` (or an alias, see :mod:`meshkit.schedules`).
        batch_size: sequences per step on this rank (what ``pipeline_step`` receives).
        microbatches, virtual_stages, split_points: see :func:`resolve_microbatches`,
            :func:`resolve_virtual_stages`, :func:`plan_split`; None picks the defaults.
        loss_fn: ``loss_fn(last stage output, labels) -> scalar mean loss``; None builds a forward-only
            pipeline.
        stage_transform: applied to each stage module before it is wrapped (e.g. TP then FSDP).
        timeline_dir: where ``pp_timeline_rank{R}.jsonl`` is written; None records nothing.

    Example (on every rank of a 4-rank gloo job; see tests/distributed/test_pipeline.py)::

        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
        pipe = build_pipeline(Transformer(LlamaConfig.tiny(n_layers=8)), mesh["pp"], schedule="gpipe", batch_size=8)
        loss = pipeline_step(pipe, tokens[:, :-1], tokens[:, 1:])  # same value on every rank
    """
    group = pp_mesh.get_group() if hasattr(pp_mesh, "get_group") else pp_mesh
    pp, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    spec = schedule_spec(schedule)
    v = resolve_virtual_stages(schedule, virtual_stages)
    resolve_microbatches(schedule, pp, batch_size, microbatches, v)  # raise before copying the model
    num_stages = pp * v
    stage_ids = stage_ids_on_rank(pp_rank, pp, v, spec.placement)
    stack, points = plan_split(model, num_stages, split_points, cost)
    modules = [build_stage_module(model, stack, s, num_stages, points) for s in stage_ids]
    if stage_transform is not None:
        modules = [stage_transform(mod, s) for mod, s in zip(modules, stage_ids)]
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    return make_pipeline(
        modules, stage_ids, group, schedule=schedule, batch_size=batch_size, microbatches=microbatches,
        virtual_stages=v, loss_fn=loss_fn, device=dev, timeline_dir=timeline_dir, split_points=points,
    )


def make_pipeline(
    modules: list[nn.Module],
    stage_ids: tuple[int, ...],
    group: Any,
    *,
    schedule: str,
    batch_size: int,
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = causal_lm_loss,
    device: torch.device | str = "cpu",
    timeline_dir: str | os.PathLike | None = None,
    split_points: list[int] | None = None,
) -> Pipeline:
    """Wrap already-built stage modules (this rank's, ``stage_ids``) in torch stages and a schedule."""
    pp = dist.get_world_size(group)
    spec = schedule_spec(schedule)
    v = resolve_virtual_stages(schedule, virtual_stages)
    m = resolve_microbatches(schedule, pp, batch_size, microbatches, v)
    num_stages = pp * v
    dev = torch.device(device)
    stages = [PipelineStage(mod, s, num_stages, dev, group=group) for mod, s in zip(modules, stage_ids)]
    recorder = TimelineRecorder(timeline_dir, dist.get_rank()) if timeline_dir is not None else None
    if recorder is not None:
        for st in stages:
            recorder.attach(st)
    sched = spec.cls(stages if spec.multi_stage else stages[0], n_microbatches=m, loss_fn=loss_fn)
    return Pipeline(
        schedule=sched, stages=stages, modules=list(modules), stage_ids=tuple(stage_ids), num_stages=num_stages,
        split_points=list(split_points or []), microbatches=m, schedule_name=canonical_schedule(schedule), group=group,
        last_stage_rank=stage_rank(num_stages - 1, pp, num_stages, spec.placement), loss_fn=loss_fn,
        recorder=recorder, device=dev,
    )


def _mean_loss_from_last_stage(pipe: Pipeline, losses: list[torch.Tensor]) -> torch.Tensor:
    """The mean micro-batch loss, sent from the last stage's rank to every pp rank."""
    if pipe.has_last_stage:
        value = torch.stack([loss.detach().float() for loss in losses]).mean()
    else:
        value = torch.zeros((), dtype=torch.float32, device=pipe.device)
    dist.broadcast(value, group=pipe.group, group_src=pipe.last_stage_rank)
    return value


def pipeline_step(pipe: Pipeline, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One forward + backward over ``pipe.microbatches`` micro-batches; gradients land in the stages.

    Returns the mean loss over micro-batches (no grad), the same on every pp rank. Call it on every
    pp rank with the same ``inputs`` (B, T) and ``labels`` (B, T); ranks without the first (last)
    stage ignore ``inputs`` (``labels``).
    """
    losses: list[torch.Tensor] = []
    args = (inputs,) if pipe.has_first_stage else ()
    target = labels if pipe.has_last_stage else None
    pipe.schedule.step(*args, target=target, losses=losses, return_outputs=False)
    if pipe.recorder is not None:
        pipe.recorder.end_step()
    return _mean_loss_from_last_stage(pipe, losses)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


def _send_tensor(t: torch.Tensor, dst: int, group: Any) -> tuple[list[Any], torch.Tensor]:
    """Send ``t`` (shape and dtype first, in a fixed 8-int header) to group rank ``dst``; returns the
    works and the sent tensor (kept alive until the works finish)."""
    header = torch.zeros(8, dtype=torch.int64, device=t.device)
    header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
    header[2 : 2 + t.dim()] = torch.tensor(t.shape)
    t = t.contiguous()
    return [dist.isend(header, group=group, group_dst=dst), dist.isend(t, group=group, group_dst=dst)], t


def _recv_tensor(src: int, group: Any, device: torch.device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    out = torch.empty(tuple(int(d) for d in header[2 : 2 + ndim]), dtype=dtype, device=device)
    dist.recv(out, group=group, group_src=src)
    return out


@torch.no_grad()
def pipeline_eval(pipe: Pipeline, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Forward-only mean loss over micro-batches through the stages, the same on every pp rank.

    Runs the stages in order with plain point-to-point sends (a GPipe-style forward, independent of
    the training schedule: torch's ``schedule.eval`` does not run the zero-bubble schedules). Not
    recorded in the timeline.
    """
    if pipe.loss_fn is None:
        raise ValueError("pipeline: `pipeline_eval` needs a pipeline built with a `loss_fn`.")
    spec = schedule_spec(pipe.schedule_name)
    pp = dist.get_world_size(pipe.group)
    m = pipe.microbatches
    x_mbs = inputs.tensor_split(m) if pipe.has_first_stage else [None] * m
    y_mbs = labels.tensor_split(m) if pipe.has_last_stage else [None] * m
    local: dict[int, list[torch.Tensor]] = {}  # stage -> outputs kept on this rank for the next stage
    pending: list[Any] = []
    losses: list[torch.Tensor] = []
    for s, module in sorted(zip(pipe.stage_ids, pipe.modules), key=lambda sm: sm[0]):
        prev_rank = stage_rank(s - 1, pp, pipe.num_stages, spec.placement) if s > 0 else None
        next_rank = stage_rank(s + 1, pp, pipe.num_stages, spec.placement) if s < pipe.num_stages - 1 else None
        me = dist.get_rank(pipe.group)
        outs = []
        for i in range(m):
            if s == 0:
                x = x_mbs[i]
            elif prev_rank == me:
                x = local[s - 1][i]
            else:
                x = _recv_tensor(prev_rank, pipe.group, pipe.device)
            y = module(x)
            if next_rank is None:
                losses.append(pipe.loss_fn(y, y_mbs[i]))
            elif next_rank == me:
                outs.append(y)
            else:
                works, kept = _send_tensor(y, next_rank, pipe.group)
                pending += [(w, kept) for w in works]
        local[s] = outs
    for w, _ in pending:
        w.wait()
    return _mean_loss_from_last_stage(pipe, losses)
