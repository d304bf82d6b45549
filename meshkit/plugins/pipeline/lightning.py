"""The pipeline side of :class:`~meshkit.plugins.strategy.NDParallelStrategy` (pp > 1).

The strategy calls four hooks; everything pipeline-specific lives here:

- ``parallelize``: :func:`meshkit.plugins.parallelize.parallelize` (the one order) with a ``split``
  hook that finds the layer-stack model in the LightningModule (``self.model`` or any direct
  child :func:`~meshkit.plugins.pipeline.find_layer_stack` accepts) and replaces it by this rank's
  *rank module* (a copy holding only this rank's blocks, plus the embedding / norm / head where
  this rank has the first / last stage; full-model FQNs, so optimizers, ``state_dict`` and DCP
  checkpoints see ``model.layers.5...`` at any pp). TP, activation checkpointing and compile then
  go over the rank module, and ``fully_shard`` over one *stage view* per local stage (sharing its
  blocks; ``reshard_after_forward=False``: a stage runs forward several times before backward).
  The pp × cp refusal runs before the process group (:func:`meshkit.plugins.presets.resolve_layout`).
- ``training_step``: splits the batch into ``(inputs, labels)``, runs
  :func:`~meshkit.plugins.pipeline.pipeline_step` (forward + backward of every micro-batch), logs
  ``train_loss`` (mean over micro-batches, the same on every rank) and returns it; the strategy's
  ``backward`` is then a no-op.
- ``validation_step`` / ``test_step``: forward-only, logs ``val_loss`` / ``test_loss``.
- ``clip``: gradient norm over all stages (each rank's norm over its DTensor meshes, then summed
  over the pp group).

**The user hook.** Under pp the LightningModule's ``training_step`` is not called (no rank holds
the whole model). The loss is computed on the last stage from its output (logits) and the labels
by ``pipeline_loss(self, output, labels)`` if the module defines it, else token-mean cross-entropy;
batches are split by ``pipeline_batch(self, batch) -> (inputs, labels)`` if defined, else a dict
``{"input_ids", "labels"}`` or a (B, T+1) token tensor (inputs ``[:, :-1]``, labels ``[:, 1:]``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from meshkit.plugins import fsdp as _fsdp
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.parallelize import ParallelConfig, parallelize
from meshkit.plugins.pipeline import (
    Pipeline,
    build_rank_module,
    causal_lm_loss,
    find_layer_stack,
    make_pipeline,
    pipeline_eval,
    pipeline_step,
    plan_split,
    resolve_microbatches,
    resolve_virtual_stages,
    schedule_spec,
    stage_ids_on_rank,
    stage_view,
)


def _split_batch(module: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(module, "pipeline_batch"):
        return module.pipeline_batch(batch)
    if isinstance(batch, dict) and "input_ids" in batch and "labels" in batch:
        return batch["input_ids"], batch["labels"]
    if isinstance(batch, torch.Tensor) and batch.dim() == 2:
        return batch[:, :-1], batch[:, 1:]
    raise ValueError(
        f"NDParallelStrategy(pp>1): cannot split a batch of type {type(batch).__name__} into (inputs, labels). "
        "Yield {'input_ids': (B, T), 'labels': (B, T)} or a (B, T+1) token tensor, or define "
        "`pipeline_batch(self, batch) -> (inputs, labels)` on the LightningModule."
    )


class PipelineHooks:
    """Pipeline state and hooks for one strategy; inactive (every hook unused) when pp == 1."""

    def __init__(
        self,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        split_points: list[int] | None = None,
        timeline_dir: str | None = None,
    ) -> None:
        # checked once by meshkit.plugins.options.NDParallelOptions (the strategy's settings)
        self.schedule, self.microbatches, self.virtual_stages = schedule.lower(), microbatches, virtual_stages
        self.split_points, self.timeline_dir = split_points, timeline_dir
        self.active = False
        self._pipes: dict[int, Pipeline] = {}

    # ---- setup --------------------------------------------------------------------------------
    def parallelize(self, lm: nn.Module, dims: ParallelDims, config: ParallelConfig, device: torch.device) -> nn.Module:
        """:func:`~meshkit.plugins.parallelize.parallelize` of ``lm`` with this rank's stages cut out first."""
        self.device = device
        _warn_user_loss_dropped(lm)
        parallelize(lm, dims, config, split=functools.partial(self._split, dims))
        self.active = True
        return lm

    def _split(self, dims: ParallelDims, lm: nn.Module) -> tuple[nn.Module, Callable[[], list[nn.Module]]]:
        """Put this rank's rank module in place of ``lm``'s model; return it and its stage views' builder."""
        attr, model = _find_model(lm)
        self.model_attr = f"self.{attr}"  # what the stages hold (a strategy check names it)
        self.group = dims.mesh["pp"].get_group()
        pp, pp_rank = dims.pp, dims.mesh["pp"].get_local_rank()
        spec = schedule_spec(self.schedule)
        v = resolve_virtual_stages(self.schedule, self.virtual_stages)
        self.num_stages = pp * v
        self.stage_ids = stage_ids_on_rank(pp_rank, pp, v, spec.placement)
        stack, points = plan_split(model, self.num_stages, self.split_points)
        rank_module = build_rank_module(model, stack, self.stage_ids, self.num_stages, points)
        setattr(lm, attr, rank_module)
        self.split_points_used = points

        def views() -> list[nn.Module]:  # after TP / AC / compile: the views share the rank module's blocks
            self.views = [stage_view(rank_module, stack, s, self.num_stages, points) for s in self.stage_ids]
            return self.views

        return rank_module, views

    def _pipe(self, lm: Any, batch_size: int, train: bool) -> Pipeline:
        key = batch_size if train else -batch_size
        if key not in self._pipes:
            loss_fn = getattr(lm, "pipeline_loss", None) or causal_lm_loss
            accumulate = max(1, int(getattr(lm.trainer, "accumulate_grad_batches", 1) or 1))

            def scaled_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                # Lightning divides the loss by accumulate_grad_batches before its backward; the
                # schedule runs backward itself, so the division happens here (undone for logging).
                return loss_fn(output, labels) / accumulate

            self._accumulate = accumulate
            if train:
                self._pipes[key] = make_pipeline(
                    self.views, self.stage_ids, self.group, schedule=self.schedule, batch_size=batch_size,
                    microbatches=self.microbatches, virtual_stages=self.virtual_stages, loss_fn=scaled_loss,
                    device=self.device, timeline_dir=self.timeline_dir, split_points=self.split_points_used,
                )
            else:
                pp = dist.get_world_size(self.group)
                m = resolve_microbatches("gpipe", pp, batch_size) if pp <= batch_size else batch_size
                self._pipes[key] = Pipeline(
                    schedule=None, stages=[], modules=self.views, stage_ids=self.stage_ids, num_stages=self.num_stages,
                    split_points=self.split_points_used, microbatches=m, schedule_name=self.schedule, group=self.group,
                    last_stage_rank=_last_rank(self), loss_fn=loss_fn, device=self.device,
                )
        return self._pipes[key]

    # ---- steps --------------------------------------------------------------------------------
    def training_step(self, lm: Any, batch: Any) -> torch.Tensor:
        inputs, labels = _split_batch(lm, batch)
        pipe = self._pipe(lm, inputs.shape[0], train=True)
        # Lightning zeroes gradients *after* training_step (right before backward), but the schedule
        # computes them inside it: set them aside here and hand them over in ``backward``.
        params = [p for p in lm.parameters() if p.requires_grad]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = pipeline_step(pipe, inputs, labels) * self._accumulate
        self._pending = [(p, p.grad) for p in params]
        for p, g in zip(params, before):
            p.grad = g
        lm.log("train_loss", loss, prog_bar=True)
        return loss

    def backward(self) -> None:
        """Add the gradients the schedule computed in ``training_step`` (after Lightning's zero_grad)."""
        for p, g in self._pending:
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self._pending = []

    def eval_step(self, lm: Any, batch: Any, name: str) -> torch.Tensor:
        inputs, labels = _split_batch(lm, batch)
        loss = pipeline_eval(self._pipe(lm, inputs.shape[0], train=False), inputs, labels)
        lm.log(name, loss, sync_dist=True)
        return loss

    @torch.no_grad()
    def clip(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over every stage, TP shard and FSDP shard."""
        local = _fsdp.clip_grad_norm_(parameters, float("inf"))  # this rank's norm; scales by 1
        total_sq = local.detach().float().pow(2).to(self.device)
        dist.all_reduce(total_sq, group=self.group)
        total = total_sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        from torch.distributed.tensor import DTensor

        for p in parameters:
            if p.grad is not None:
                g = p.grad
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.device))
        return total


def _warn_user_loss_dropped(lm: nn.Module) -> None:
    """Warn once (rank 0) that a user's ``training_step`` is not called under pp and no ``pipeline_loss`` replaces it."""
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    step = getattr(type(lm), "training_step", None)
    if not is_overridden("training_step", lm) or hasattr(lm, "pipeline_loss"):
        return
    if getattr(step, "__module__", "").startswith("meshkit."):  # meshkit's own modules compute the default loss
        return
    rank_zero_warn(
        f"NDParallelStrategy(pp>1): `{type(lm).__name__}.training_step` is not called under pipeline parallelism "
        "(no rank holds the whole model); the last stage computes token-mean cross-entropy on the logits instead, "
        "so a custom loss (label smoothing, z-loss, masking, weighting) is dropped. Define "
        "`pipeline_loss(self, output, labels) -> loss` on the LightningModule to use your own."
    )


def _last_rank(hooks: PipelineHooks) -> int:
    from meshkit.plugins.pipeline.schedule import stage_rank

    return stage_rank(hooks.num_stages - 1, dist.get_world_size(hooks.group), hooks.num_stages,
                      schedule_spec(hooks.schedule).placement)


def _find_model(lm: nn.Module) -> tuple[str, nn.Module]:
    errors = []
    for name, child in lm.named_children():
        try:
            find_layer_stack(child)
            return name, child
        except ValueError as e:
            errors.append(f"{name}: {e}")
    raise ValueError(
        f"NDParallelStrategy(pp>1): no direct child of {type(lm).__name__} is a layer-stack model meshkit can split. "
        + (" | ".join(errors) if errors else "It has no child modules.")
    )
