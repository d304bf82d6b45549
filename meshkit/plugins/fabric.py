"""NDParallelFabricStrategy: the meshkit presets for Lightning Fabric's hand-written loops.

The Trainer's :class:`~meshkit.plugins.strategy.NDParallelStrategy` and this strategy are two thin front
doors over the same functions: the layout checks (:func:`~meshkit.plugins.presets.resolve_layout`), the
process-group start (:func:`~meshkit.plugins.rendezvous.rendezvous`), the mesh
(:meth:`~meshkit.plugins.dims.ParallelDims.build_mesh`), the parallelize order
(:func:`~meshkit.plugins.parallelize.parallelize`), the meta-device init
(:func:`~meshkit.plugins.materialize.materialize`), the gradient clipping over every mesh axis
(:func:`~meshkit.plugins.fsdp.clip_grad_norm_`) and the checkpoint files
(:func:`~meshkit.plugins.checkpoint.save_checkpoint` / :func:`~meshkit.plugins.checkpoint.load_checkpoint`:
atomic, verified against the manifest, no unpickling, resharding on load). ``import meshkit`` registers
every preset name in Fabric's strategy registry too::

    fabric = L.Fabric(strategy="hsdp_tp", devices=8, num_nodes=4, precision="bf16-mixed")
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))

What the loop calls, and what it runs here:

- ``fabric.launch()``: every check that needs no collective, then the rendezvous (its roll call names
  missing ranks);
- ``fabric.setup(model, optimizer)`` or ``fabric.setup_module(model)`` + ``fabric.setup_optimizers(...)``:
  the layout is resolved with the model ("auto" tp reads its heads), the mesh built, ``parallelize()``
  applied and meta parameters materialized. ``parallelize`` replaces every parameter by a sharded one; an
  optimizer given to ``fabric.setup`` is re-pointed to them by name (:func:`rebind_optimizer`);
- ``fabric.setup_dataloaders``: a sampler over the data-parallel ranks (``mesh["dp"]``: tp and cp peers share
  a batch);
- ``fabric.strategy.shard_batch(batch)`` and ``fabric.strategy.loss_mean(loss, batch)``: under cp > 1 this
  rank's part of every sequence, and the loss's dp × cp mean (the Trainer's strategy calls the same two
  functions, :mod:`meshkit.plugins.context_parallel.steps`); without cp both return their input, so one loop
  serves every preset;
- ``with fabric.strategy.loss_context():`` around the loss and ``fabric.backward`` (``loss_parallel=True``: the
  logits stay vocab-sharded and cross-entropy runs on the shards);
- ``fabric.backward``, ``fabric.clip_gradients(model, optimizer, max_norm=...)`` (the norm over every mesh axis)
  or ``clip_val=`` (elementwise, on the reduced gradient shards), ``fabric.no_backward_sync(model)`` for
  accumulation micro-steps (FSDP2 skips its reduce-scatter; the last micro-step syncs);
- ``fabric.save(path, state)`` / ``fabric.load(path, state)``: a meshkit DCP folder.

Pipeline parallelism (pp > 1) is refused before any collective: its schedule runs forward and backward of
every micro-batch itself (``schedule.step``), so the loop's ``model(...)`` / ``fabric.backward`` have no place;
use ``L.Trainer(strategy=...)`` for the pipeline presets.

A context-parallel loop (``L.Fabric(strategy="hsdp_cp")``)::

    for batch in fabric.setup_dataloaders(loader):        # {"input_ids": (B, T)} dicts, or (B, T+1) tokens
        batch = fabric.strategy.shard_batch(batch)        # cp > 1: T / cp tokens of every row, global positions
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss  # the one-process loss's part
        fabric.backward(loss)
        loss = fabric.strategy.loss_mean(loss, batch)     # the dp × cp mean: what to log
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from meshkit.plugins import checkpoint as _ckpt
from meshkit.plugins import context_parallel as _cp
from meshkit.plugins import fsdp as _fsdp
from meshkit.plugins.checkpoint.state import FABRIC_STATE, TIED_WEIGHTS
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.materialize import materialize
from meshkit.plugins.parallelize import ParallelConfig, loss_context, parallelize
from meshkit.plugins.options import FABRIC_UNSUPPORTED, NDParallelOptions, build_options, front_door_signature
from meshkit.plugins.presets import check_launch, register_names, resolve_layout
from meshkit.plugins.rendezvous import exit_with_parent, rendezvous

__all__ = ["NDParallelFabricStrategy", "rebind_optimizer", "register_fabric_presets"]


class NDParallelFabricStrategy(ModelParallelStrategy):
    """HSDP (FSDP2 over a replicate × shard mesh) × tensor × context parallel for ``lightning.fabric.Fabric``.

    The Fabric twin of :class:`~meshkit.plugins.strategy.NDParallelStrategy`: the same presets, sizes and
    settings (those of a hand-written loop), the same ``parallelize()``, checks and checkpoint files.

    Args:
        preset: a name from :data:`~meshkit.plugins.presets.PRESETS`: which axes ``"auto"`` turns on (default
            ``"hsdp_tp"``, or ``options.preset``). The pipeline presets are refused (use the Trainer for them); under
            a context-parallel one the loop calls :meth:`shard_batch` and :meth:`loss_mean`.
        options: an :class:`~meshkit.plugins.options.NDParallelOptions`, the Trainer strategy's record; the
            keyword arguments override it.
        **settings: any field of :class:`~meshkit.plugins.options.NDParallelOptions` by keyword, each documented
            there: the sizes ``dp_replicate dp_shard cp tp`` (or ``"auto"``; ``pp`` must resolve to 1),
            ``tp_plan``, ``sequence_parallel``, ``loss_parallel`` (the loop computes its loss and calls
            ``fabric.backward`` under :meth:`loss_context`), ``cp_attention``, ``cp_layout``,
            ``activation_checkpointing``, ``compile``, ``reshard_after_forward``, ``global_batch_size``,
            ``allow_unverified``, ``fused_kernels``, ``process_group_backend``, ``timeout``. Those only the Trainer
            runs (:data:`~meshkit.plugins.options.FABRIC_UNSUPPORTED`: ``save_distributed_checkpoint`` and the pp
            settings) are refused at any value but their default.
            The result is :attr:`options`.

    Example::

        >>> import lightning as L, meshkit
        >>> fabric = L.Fabric(strategy=meshkit.NDParallelFabricStrategy(dp_shard=2, tp=2), accelerator="cpu",
        ...                   devices=4)  # doctest: +SKIP
        >>> fabric.launch()  # doctest: +SKIP
        >>> model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
    """

    strategy_name = "nd_parallel_fabric"

    def __init__(
        self, preset: Optional[str] = None, *, options: Optional[NDParallelOptions] = None, **settings: Any
    ) -> None:
        name = type(self).__name__
        opts = build_options(name, preset, options, settings)
        refused = opts.non_default(FABRIC_UNSUPPORTED)
        if refused:
            given = ", ".join(f"`{n}={getattr(opts, n)!r}`" for n in refused)
            why = "; ".join(dict.fromkeys(FABRIC_UNSUPPORTED[n] for n in refused))
            raise ValueError(
                f"{name}: {given} not supported under Fabric ({why}). Drop "
                f"{'it' if len(refused) == 1 else 'them'}, or train with `L.Trainer(strategy=NDParallelStrategy(...))`, "
                "which takes every NDParallelOptions field."
            )
        super().__init__(
            parallelize_fn=self._parallelize, save_distributed_checkpoint=True,
            process_group_backend=opts.process_group_backend, timeout=opts.timeout,
        )
        self.options = opts
        """The settings this strategy was built with (frozen, validated)."""
        self.preset = opts.preset
        self.parallel_config = opts.parallel_config()
        """Every setting of the automatic path; ``precision`` is filled from Fabric's precision."""
        self._parallel_dims: Optional[ParallelDims] = None
        self._modules: list[nn.Module] = []
        self._sharded_batches = 0  # shard_batch calls: a cp forward before the first one is refused
        self._cp_applied: Optional[_cp.CPApplied] = None  # the first set-up cp model's record (setup_module)

    # ---- layout -------------------------------------------------------------------------------
    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved degrees and the mesh (built when the first model or dataloader is set up)."""
        return self._layout()

    @property
    @override
    def device_mesh(self) -> Any:
        """The mesh, axes ``dp_replicate dp_shard pp cp tp`` (named sub-meshes ``dp``, ``dp_shard_cp``, ...)."""
        return self._layout().mesh

    def _resolve(self, module: Optional[nn.Module]) -> ParallelDims:
        """Every check that needs no collective, on every rank; with ``module``, its shape too."""
        precision = getattr(self.precision, "precision", "32-true")
        self.parallel_config = self.options.parallel_config(precision)
        world = self.num_nodes * self.num_processes
        dims = resolve_layout(
            self.preset, self.options.sizes, self.parallel_config, world_size=world, num_nodes=self.num_nodes,
            model=module, planner=(lambda: self._planned_dims(module, world)) if module is not None else None,
        )
        name = type(self).__name__
        if dims.pp_enabled:
            raise ValueError(
                f"{name}: `pp={dims.pp}` is not supported under Fabric: a pipeline schedule runs forward and backward "
                "of every micro-batch itself (`schedule.step`), so a hand-written loop's `model(...)` and "
                "`fabric.backward(loss)` have no place in it. Use "
                f"`L.Trainer(strategy={self.preset.name!r})` (NDParallelStrategy: the schedule inside its "
                f"training step), or keep Fabric with `pp=1`: `{name}({self.preset.name!r}, pp=1, ...)` or a preset "
                "without pp (e.g. 'hsdp_tp')."
            )
        return dims

    def _planned_dims(self, module: nn.Module, world: int) -> ParallelDims:
        """``auto_nd``: the planner's layout for this world, device and model."""
        from meshkit.plugins.dims import auto_nd_dims

        dev, c = self.root_device, self.parallel_config
        return auto_nd_dims(
            module, world_size=world, num_nodes=self.num_nodes,
            device="cpu" if dev.type == "cpu" else torch.cuda.get_device_name(dev),
            memory_gb=None if dev.type == "cpu" else torch.cuda.get_device_properties(dev).total_memory / 2**30,
            global_batch=c.global_batch_size, reshard_after_forward=c.reshard_after_forward,
            sequence_parallel=c.sequence_parallel, activation_checkpointing=c.activation_checkpointing,
            log=rank_zero_info,
        )

    def _layout(self, module: Optional[nn.Module] = None) -> ParallelDims:
        """The dims and their mesh, built once (a collective on every rank); a later model must fit them."""
        if self._parallel_dims is not None and module is None:
            return self._parallel_dims
        dims = self._resolve(module)
        if self._parallel_dims is None:
            dims.build_mesh(self.root_device.type, timeout=self._timeout)  # every sub-group gets `timeout=`
            self._parallel_dims = dims
            self._device_mesh = dims.mesh
            rank_zero_info(f"meshkit: {self.preset.name} layout {dims} on {self.num_nodes} node(s) (Fabric)")
        elif dims.degrees != self._parallel_dims.degrees:
            raise ValueError(
                f"{type(self).__name__}: the layout {self._parallel_dims.degrees} was fixed before this model was "
                f"set up (by `fabric.setup_dataloaders` or `strategy.device_mesh`), but {type(module).__name__} "
                f"resolves to {dims.degrees}. Call `fabric.setup(model, ...)` first, or pass explicit sizes "
                "(`NDParallelFabricStrategy(dp_shard=..., tp=...)`)."
            )
        return self._parallel_dims

    @override
    def setup_environment(self) -> None:
        # Launcher vs Fabric, then the model-free layout checks: every check before the first collective.
        env = self.cluster_environment
        assert env is not None
        initialized = torch.distributed.get_world_size() if torch.distributed.is_initialized() else None
        check_launch(self.num_processes, self.num_nodes, os.environ if env.creates_processes_externally else {},
                     initialized)
        self._resolve(None)
        ParallelStrategy.setup_environment(self)  # the accelerator's device; the mesh waits for the model
        if type(env) is LightningEnvironment and env.local_rank() > 0:  # started by Lightning's launcher (rank 0)
            exit_with_parent(env.global_rank())
        rendezvous(self._setup_distributed, address=env.main_address, port=env.main_port,
                   rank=self.node_rank * self.num_processes + self.local_rank, devices=self.num_processes,
                   num_nodes=self.num_nodes, timeout=self._timeout, initialized=initialized is not None,
                   owner=type(self).__name__)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.parallel_dims.submesh("dp")
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    # ---- model and optimizers ----------------------------------------------------------------------
    def _parallelize(self, module: nn.Module, mesh: Any) -> nn.Module:
        """Lightning's ``parallelize_fn``: :func:`~meshkit.plugins.parallelize.parallelize` with the resolved dims."""
        return parallelize(module, self.parallel_dims, self.parallel_config)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Resolve the layout with ``module``, build the mesh, ``parallelize`` and materialize it (in place), as the
        Trainer's strategy does."""
        self._layout(module)
        module = self._parallelize(module, self.device_mesh)
        materialize(module, self.root_device)  # empty_init: the model's own init, or a clear error
        module = self.precision.convert_module(module)
        module.to(self.root_device)
        if self.parallel_dims.cp_enabled:  # before FSDP's own pre-forward (its all-gather): no collective yet
            module.register_forward_pre_hook(self._check_sharded, prepend=True)
        self._modules.append(module)
        self._cp_applied = self._cp_applied or _cp.cp_applied(module)  # once here, not per batch (shard_batch)
        return module

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        """``fabric.setup(model, optimizer)``: the optimizers were built on the unsharded parameters; after
        ``parallelize`` they hold the sharded ones, found by name (:func:`rebind_optimizer`)."""
        names = _names_of(module)
        for optimizer in optimizers:
            _check_fresh(optimizer, names, type(self).__name__)
        module = self.setup_module(module)
        for optimizer in optimizers:
            rebind_optimizer(optimizer, names, module)
        return module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers``: every parameter must be one of a set-up model's (sharded) parameters."""
        stale = _fsdp.stale_optimizer_parameters(nn.ModuleList(self._modules), [optimizer])
        if stale:
            _, kind, n, total = stale[0]
            raise ValueError(
                f"{type(self).__name__}: {kind} holds {n} of its {total} parameter(s) that are not parameters of a "
                "model set up by this strategy: `fabric.setup_module` replaces "
                "every parameter by a sharded one, so an optimizer built before it would update tensors the model no "
                "longer uses. Build the optimizer from `model.parameters()` after `fabric.setup_module(model)`, or "
                "pass both to `fabric.setup(model, optimizer)`."
            )
        return optimizer

    # ---- steps ----------------------------------------------------------------------------------
    def shard_batch(self, batch: Any) -> Any:
        """This rank's part of ``batch`` under cp > 1, ``batch`` itself otherwise: what the Trainer's strategy
        does to every batch (:func:`~meshkit.plugins.context_parallel.step_batch`). Call it on each batch the
        loop feeds the model, after ``fabric.setup_dataloaders`` moved it to the device.

        ``batch`` is a dict with ``input_ids`` (and ``labels`` already shifted, if any) or a (B, T+1) token
        tensor; under cp the result is a :class:`~meshkit.plugins.context_parallel.CPBatch` of ``input_ids``,
        ``labels`` and ``positions`` (T / cp tokens of every row). With transformers,
        ``model(input_ids=b["input_ids"], labels=b["input_ids"]).loss`` is then this rank's part of the
        one-process loss; a loss by hand: ``meshkit.loss.cross_entropy(logits, b["labels"])``.

        Example::

            >>> batch = fabric.strategy.shard_batch(batch)  # doctest: +SKIP
        """
        self._sharded_batches += 1
        return _cp.step_batch(batch, self.parallel_dims, self.parallel_config.cp_layout, self._cp_applied)

    def loss_mean(self, loss: torch.Tensor, batch: Any = None) -> torch.Tensor:
        """Under cp > 1: ``loss`` with its value averaged over the dp × cp ranks (every rank the same), its
        gradient the local one; ``loss`` itself otherwise (:func:`~meshkit.plugins.context_parallel.step_loss`).

        Each cp rank's loss is its part of its replica's (``Σ_local / (N / cp)``), not a loss to log. Pass the
        :meth:`shard_batch` batch too: a per-rank mean over uneven target counts (``F.cross_entropy`` on
        ``labels`` with -100s) is then warned about once. One all-reduce; call it on every rank.

        Example::

            >>> fabric.log("train_loss", fabric.strategy.loss_mean(loss, batch).item())  # doctest: +SKIP
        """
        return _cp.step_loss(loss, batch, self.parallel_dims)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """The context the loop computes its loss in: torch's ``loss_parallel()`` with ``loss_parallel=True``
        (the logits are vocab-sharded DTensors; ``F.cross_entropy`` runs on the shards), else one that does
        nothing (:func:`~meshkit.plugins.parallelize.loss_context`). ``fabric.backward(loss)`` goes inside it too
        (the backward of the sharded cross-entropy is torch's loss-parallel one only there).

        Example::

            >>> with fabric.strategy.loss_context():  # doctest: +SKIP
            ...     loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
            ...     fabric.backward(loss)
        """
        return loss_context(self.parallel_dims, self.parallel_config)

    def _check_sharded(self, module: nn.Module, args: Any) -> None:
        if self._sharded_batches == 0:
            raise ValueError(
                f"{type(self).__name__}: `cp={self.parallel_dims.cp}`, but the model was called before any batch "
                "went through `fabric.strategy.shard_batch(batch)`: every cp rank would feed it whole sequences as "
                "if they were its part of them. Call `batch = fabric.strategy.shard_batch(batch)` on each batch "
                "before the model, and `fabric.strategy.loss_mean(loss, batch)` for the loss to log."
            )

    @override
    def clip_gradients_norm(
        self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """The norm over every mesh axis (:func:`~meshkit.plugins.fsdp.clip_grad_norm_`); returns it (before clipping)."""
        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        total = _fsdp.clip_grad_norm_(params, float(max_norm), float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"{type(self).__name__}: the total norm of order {norm_type} of the gradients is {float(total)}, so "
                "they cannot be clipped. Find the non-finite loss or gradient, or pass "
                "`fabric.clip_gradients(..., error_if_nonfinite=False)`."
            )
        return total

    # ---- checkpoints: the states gathered here, the files written by meshkit.plugins.checkpoint --------
    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """A meshkit DCP folder at ``path``: atomic and hashed (see :mod:`meshkit.plugins.checkpoint`).

        ``state`` holds one model, its optimizers and anything else (``_Stateful`` objects by their
        ``state_dict()``); the entries' names are recorded, and :meth:`load_checkpoint` checks them.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        name = type(self).__name__
        if storage_options is not None:
            raise TypeError(
                f"`{name}.save_checkpoint(..., storage_options=...)` is not supported: meshkit writes checkpoints "
                "itself, not through a CheckpointIO plugin."
            )
        if filter is not None:
            raise ValueError(
                f"{name}: `fabric.save(..., filter=...)` is not supported: a meshkit checkpoint holds the whole model "
                "and optimizer state, so a load resumes exactly. Save without `filter=`; export weights with "
                "`meshkit consolidate`."
            )
        module_key, module, optimizers = _split_state(state, name, "save")
        rest = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in state.items()
                if k != module_key and k not in optimizers}
        rest[FABRIC_STATE] = {"module": module_key, "optimizers": list(optimizers)}
        model_state = get_model_state_dict(module, options=StateDictOptions(cpu_offload=True))
        _ckpt.save_checkpoint(
            self.broadcast(path), model_state, [_ckpt.flat_optimizer_state(module, o) for o in optimizers.values()],
            rest, tied=_ckpt.tied_aliases(module), sharded=True, rank=self.global_rank, barrier=self.barrier,
        )

    @override
    def load_checkpoint(
        self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None, strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Verify and load ``path`` (a meshkit folder, or a single file the Trainer wrote) into ``state``'s model and
        optimizers (DCP reshards: any layout); other entries of ``state`` are replaced (``_Stateful`` ones load in
        place); returns what ``state`` did not ask for. ``weights_only`` defaults to True."""
        name = type(self).__name__
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"{name}: `fabric.load(path, state)` needs the state to restore, a dict with the set-up model, e.g. "
                "`fabric.load(path, {'model': model, 'optimizer': optimizer})` (got "
                f"{type(state).__name__}). Exported weights: `model.load_state_dict(meshkit.plugins.checkpoint."
                "load_weights(path))` before `fabric.setup`."
            )
        module_key, module, optimizers = _split_state(state, name, "load")
        meta = _ckpt.load_checkpoint(
            self.broadcast(path), module, list(optimizers.values()), weights_only=weights_only, strict=strict,
            rank=self.global_rank, world_size=self.world_size, barrier=self.barrier,
            allow_unverified=self.options.allow_unverified,
        )
        meta.pop(TIED_WEIGHTS, None)
        saved = meta.pop(FABRIC_STATE, None)
        wanted = {"module": module_key, "optimizers": list(optimizers)}
        if saved is not None and saved != wanted:
            raise _ckpt.CheckpointError(
                f"checkpoint `{path}` was saved from the state entries model {saved['module']!r} and optimizers "
                f"{saved['optimizers']} (in this order), but `fabric.load` was given model {module_key!r} and "
                f"optimizers {list(optimizers)}: optimizer states load by position. Pass the same keys, in the same "
                "order, as `fabric.save` was given."
            )
        requested = [k for k in state if k != module_key and k not in optimizers]
        _validate_keys_for_strict_loading(requested, meta.keys(), strict=strict)
        for key in requested:
            if key not in meta:
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(meta.pop(key))
            else:
                state[key] = meta.pop(key)
        return meta


NDParallelFabricStrategy.__init__.__signature__ = front_door_signature(NDParallelFabricStrategy)  # type: ignore[attr-defined]


def _params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names_of(module: nn.Module) -> dict[int, str]:
    """``{id(parameter): FQN}`` of every parameter, before ``parallelize`` replaces them."""
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def _check_fresh(optimizer: Optimizer, names: dict[int, str], owner: str) -> None:
    """An optimizer handed to ``fabric.setup`` must hold only the model's parameters and no state yet."""
    foreign = [i for i, p in enumerate(_params(optimizer)) if id(p) not in names]
    if foreign:
        raise ValueError(
            f"{owner}: {len(foreign)} parameter(s) of {type(optimizer).__name__} (positions {foreign[:5]}) are not "
            "parameters of the model given to `fabric.setup` with it. Build the optimizer from that model's "
            "`parameters()`."
        )
    if optimizer.state:
        raise ValueError(
            f"{owner}: {type(optimizer).__name__} already holds state for {len(optimizer.state)} parameter(s) "
            "(it has stepped): that state belongs to the unsharded parameters `fabric.setup` replaces. Set the model "
            "and optimizer up before the first step; to resume, load a checkpoint after `fabric.setup` with "
            "`fabric.load(path, {'model': model, 'optimizer': optimizer})`."
        )


def rebind_optimizer(optimizer: Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """Point ``optimizer``'s param groups at ``module``'s current parameters, matched by FQN.

    ``names`` is ``{id(parameter): FQN}`` taken before ``parallelize`` replaced the parameters (FSDP2 and TP
    register new, sharded ``nn.Parameter`` objects); a tied parameter keeps one entry.

    Example::

        >>> lin = nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        >>> names = {id(p): n for n, p in lin.named_parameters()}
        >>> lin.weight = nn.Parameter(lin.weight.detach().clone())  # what parallelize does, sharded
        >>> rebind_optimizer(opt, names, lin)
        >>> opt.param_groups[0]["params"][0] is lin.weight
        True
    """
    current = dict(module.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        group["params"] = [current[names[id(p)]] for p in group["params"]]


def _split_state(state: dict[str, Any], owner: str, verb: str) -> tuple[str, nn.Module, dict[str, Optimizer]]:
    """``(the model's key, the model, {key: optimizer})`` of a Fabric state dict: exactly one model."""
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    if len(modules) != 1:
        raise ValueError(
            f"{owner}: `fabric.{verb}(path, state)` needs exactly one model in the state (found "
            f"{sorted(modules) or 'none'}), e.g. `{{'model': model, 'optimizer': optimizer, 'step': step}}`. Save each "
            "model to its own path."
        )
    (key, module), = modules.items()
    return key, module, {k: v for k, v in state.items() if isinstance(v, Optimizer)}


def register_fabric_presets(registry: Any = None) -> None:
    """Register every preset name with Fabric's strategy registry (done on ``import meshkit``)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    register_names(registry if registry is not None else STRATEGY_REGISTRY, NDParallelFabricStrategy,
                   "Fabric strategy")
