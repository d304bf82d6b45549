"""ParallelDims: the degrees of each parallel axis, their validation, and the one DeviceMesh.

Axes run from the slowest link (outermost) to the fastest (innermost)::

    ("dp_replicate", "dp_shard", "pp", "cp", "tp")

so tp groups are consecutive ranks inside one node. Every axis is in the mesh, size 1
included, so ``mesh["tp"]`` always exists. Flattened axes:

- ``dp``           = dp_replicate × dp_shard  (data: each dp rank sees different samples)
- ``dp_shard_cp``  = dp_shard × cp            (what FSDP shards parameters over)
- ``dp_cp``        = dp_replicate × dp_shard × cp (gradients / loss are averaged over it)

Lightning's ``ModelParallelStrategy`` names work too, so a ``configure_model`` written for it runs
unchanged: ``mesh["data_parallel"]`` is ``dp`` and ``mesh["tensor_parallel"]`` is ``tp``
(:data:`LIGHTNING_ALIASES`).

Example::

    >>> from meshkit.plugins.dims import ParallelDims
    >>> dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
    >>> dims.dp_shard, dims.dp_size, dims.fsdp_enabled, dims.tp_enabled
    (2, 4, True, True)
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Union

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "AXES", "Degree", "LIGHTNING_ALIASES", "auto_nd_dims"]

AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "pp", "cp", "tp")
LIGHTNING_ALIASES: dict[str, tuple[str, ...]] = {
    "data_parallel": ("dp_replicate", "dp_shard"),
    "tensor_parallel": ("tp",),
}
"""Lightning ``ModelParallelStrategy`` axis name -> the meshkit axes it spans."""
Degree = Union[int, str]


@dataclass
class ParallelDims:
    """Degrees of the five parallel axes for a world of ``world_size`` ranks.

    Each degree is a positive int; ``dp_shard`` may be ``-1`` (or ``"auto"``): it then takes
    whatever the other axes leave of the world.
    """

    dp_replicate: int = 1
    """Replicas of the (sharded) model; HSDP's outer axis. 1: no replication."""
    dp_shard: int = -1
    """Ranks each parameter is sharded over by FSDP2. -1: fill the rest of the world."""
    pp: int = 1
    """Pipeline stages. 1: no pipeline."""
    cp: int = 1
    """Context-parallel ranks splitting the sequence. 1: no context parallelism."""
    tp: int = 1
    """Tensor-parallel ranks splitting each layer. 1: no tensor parallelism."""
    world_size: int = 1
    """Total ranks; the product of the degrees must equal it."""
    order: tuple[str, ...] = field(default=AXES)
    """Mesh axis order, outermost (slowest link) first."""

    def __post_init__(self) -> None:
        if self.dp_shard in ("auto", None):
            self.dp_shard = -1
        for name in AXES + ("world_size",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"ParallelDims: `{name}={value!r}` must be an int.")
            if value < 1 and not (name == "dp_shard" and value == -1):
                hint = " (or -1 for dp_shard to fill the rest)" if name == "dp_shard" else ""
                raise ValueError(f"ParallelDims: `{name}={value}` must be >= 1{hint}.")
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"ParallelDims: `order={self.order}` must be a permutation of {AXES}.")
        others = self.dp_replicate * self.pp * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    "ParallelDims: the sizes "
                    f"`dp_replicate={self.dp_replicate}`, `pp={self.pp}`, `cp={self.cp}`, `tp={self.tp}` multiply to "
                    f"{others}, which does not divide the world size ({self.world_size}), so `dp_shard=-1` cannot "
                    "fill it. Choose sizes whose product divides the world size."
                )
            self.dp_shard = self.world_size // others
        if others * self.dp_shard != self.world_size:
            raise ValueError(
                "ParallelDims: the sizes "
                + ", ".join(f"`{a}={getattr(self, a)}`" for a in AXES)
                + f" multiplied ({others * self.dp_shard}) should equal the world size ({self.world_size})."
                " Change one of them, or pass `dp_shard=-1` to fill the rest."
            )
        self._mesh: DeviceMesh | None = None
        self._world: Any = None  # the default process group the mesh was built on

    # ---- one-line properties ------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1 or self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def __str__(self) -> str:
        return " × ".join(f"{a}={getattr(self, a)}" for a in self.order)

    # ---- checks a model must pass ---------------------------------------------------------------
    def check_model_shape(self, heads: int | None, kv_heads: int | None, hidden: int | None) -> None:
        """Raise if ``tp`` does not divide the attention heads, kv heads or hidden size."""
        bad = [
            f"`{name}={value}`"
            for name, value in (("num_heads", heads), ("num_kv_heads", kv_heads), ("hidden_size", hidden))
            if value is not None and value % self.tp
        ]
        if bad:
            fits = [d for d in range(1, self.tp + 1) if all(v is None or v % d == 0 for v in (heads, kv_heads, hidden))]
            raise ValueError(
                f"ParallelDims: `tp={self.tp}` must divide the model's {', '.join(bad)}: each TP rank holds a whole "
                f"number of heads. Use tp in {fits} (the largest that divides all of them is {max(fits)})."
            )

    def check_batch(self, global_batch_size: int) -> None:
        """Raise if ``global_batch_size`` cannot be split evenly over the data-parallel ranks."""
        if global_batch_size % self.dp_size:
            raise ValueError(
                f"ParallelDims: `global_batch_size={global_batch_size}` is not divisible by the data-parallel size "
                f"`dp_replicate*dp_shard={self.dp_size}`; each dp rank must get the same number of sequences. "
                f"Use a multiple of {self.dp_size}."
            )

    def check_step_batch(self, global_batch_size: int, per_rank: int, accumulate: int = 1) -> None:
        """Raise unless a step's sequences (``per_rank`` per batch x dp ranks x ``accumulate`` micro-batches) are
        the declared ``global_batch_size`` (what the planner and the MFU numbers assume)."""
        seen = per_rank * self.dp_size * accumulate
        if seen != global_batch_size:
            want, rem = divmod(global_batch_size, self.dp_size * accumulate)
            fix = f"a DataLoader `batch_size={want}`" if not rem and want else "a DataLoader batch size that fits"
            raise ValueError(
                f"NDParallelStrategy: `global_batch_size={global_batch_size}` but a step trains on {seen} sequences: "
                f"batch {per_rank} per rank x `dp_replicate*dp_shard={self.dp_size}` x "
                f"`accumulate_grad_batches={accumulate}`. Use {fix}, or `global_batch_size={seen}`."
            )

    # ---- the mesh -----------------------------------------------------------------------------
    def build_mesh(self, device_type: str, timeout: "timedelta | None" = None) -> "DeviceMesh":
        """Build (once) the DeviceMesh over all ranks with every axis named, plus the flattened axes.

        ``timeout`` reaches every sub-group the mesh creates (torch gives them its 30 min default
        otherwise, whatever the default group's timeout): a collective that waits on a frozen or dead
        rank fails after ``timeout`` on every axis.

        One mesh per layout and process: a later ``build_mesh`` with the same degrees, order, device
        type and timeout on the same default group returns the same mesh and its groups
        (:data:`_MESHES`), so a process that runs many fits does not add ~10 groups (~30 threads) per fit.
        """
        import torch.distributed as dist

        world = dist.group.WORLD
        if self._mesh is not None and self._world is world:
            return self._mesh
        for stale in [k for k, (w, _, _) in _MESHES.items() if w() is not world]:  # its default group is gone
            del _MESHES[stale]
        shape = tuple(getattr(self, a) for a in self.order)
        key = (device_type, shape, self.order, timeout)
        if world is None or key not in _MESHES:  # None: init_device_mesh starts the default group itself
            mesh, flat = _new_mesh(device_type, shape, self.order, timeout)
            world = dist.group.WORLD
            _MESHES[key] = (weakref.ref(world), mesh, flat)
        _, self._mesh, self._flat = _MESHES[key]
        self._world = world
        return self._mesh

    @property
    def mesh(self) -> "DeviceMesh":
        if self._mesh is None:
            raise RuntimeError("ParallelDims.mesh: call `build_mesh(device_type)` first (after the process group).")
        return self._mesh

    def submesh(self, name: str) -> "DeviceMesh":
        """The 1-D mesh of one axis (``"tp"``, ...) or flattened axis (``"dp"``, ``"dp_shard_cp"``, ``"dp_cp"``)."""
        if name in AXES:
            return self.mesh[name]
        if name not in self._flat:
            raise ValueError(f"ParallelDims.submesh: unknown axis `{name}`; use one of {AXES + tuple(self._flat)}.")
        return self._flat[name]

    def fsdp_mesh(self) -> "DeviceMesh":
        """The mesh FSDP2 shards over: 2-D (dp_replicate, dp_shard[×cp]) for HSDP, else 1-D dp_shard[×cp]."""
        mesh = self.mesh
        if self.dp_replicate == 1:
            return self.submesh("dp_shard_cp") if self.cp > 1 else mesh["dp_shard"]
        if self.cp == 1:
            return mesh[("dp_replicate", "dp_shard")]
        import warnings

        with warnings.catch_warnings():  # slicing a flattened axis with a root axis: no other way in torch 2.13
            warnings.simplefilter("ignore", UserWarning)
            return mesh[("dp_replicate", "dp_shard_cp")]



_MESHES: "dict[tuple, tuple[weakref.ref, DeviceMesh, dict[str, DeviceMesh]]]" = {}
"""(device type, shape, order, timeout) -> (the default group, the mesh, its flattened axes).

torch.distributed keeps every group until ``destroy_process_group`` and torch's DTensor caches
(``_redistribute._planner_cache``, the sharding propagator's) keep every mesh alive, so a new mesh per
fit is never freed: a process running fits one after another (a sweep, a notebook, a test pool)
grew by 10 groups, ~30 threads, per hsdp_tp fit. Reusing the layout's mesh bounds them by the number
of layouts. Its groups are never destroyed by meshkit: the trained model, ``trainer.strategy``,
``validate``/``test``/``save_checkpoint`` after ``fit`` all still use them.
"""


def _new_mesh(
    device_type: str, shape: tuple[int, ...], order: tuple[str, ...], timeout: "timedelta | None"
) -> "tuple[DeviceMesh, dict[str, DeviceMesh]]":
    """The mesh (every sub-group with ``timeout``) and its flattened axes, built on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    backend = _backend_with_timeout(timeout)
    override = {a: backend for a in order} if backend is not None else None
    with _one_group_per_rank_set(), _singleton_groups_share_a_device():
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=order, backend_override=override)
        # Flattened axes, kept here rather than sliced from the root again (torch deprecates that).
        # DeviceMesh._flatten is private; checked on torch 2.6-2.13.
        flat = {
            "dp": mesh[("dp_replicate", "dp_shard")]._flatten("dp", backend_override=backend),
            "dp_shard_cp": mesh[("dp_shard", "cp")]._flatten("dp_shard_cp", backend_override=backend),
            "dp_cp": mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp", backend_override=backend),
        }
        for alias, axes in LIGHTNING_ALIASES.items():  # registered on the root: mesh["tensor_parallel"] works
            mesh[axes]._flatten(alias, backend_override=backend)
    return mesh, flat


@contextlib.contextmanager
def _one_group_per_rank_set() -> Iterator[None]:
    """While meshkit builds its mesh, torch's DeviceMesh gets one process group per set of ranks.

    Every axis is in the mesh and three flattened axes plus Lightning's two names sit beside them, so
    at dp_shard=2 × tp=2 torch would create 10 groups where 3 rank sets exist: the size-1 axes
    (dp_replicate, pp, cp) are each a group of this rank alone, and ``dp``, ``dp_shard_cp``, ``dp_cp``
    and ``data_parallel`` are the ranks of ``dp_shard``. Each gloo group runs an event loop that wakes
    every 10 ms even when idle (2,161 wakeups in 2 s on rank 0 with 11 groups, 596 with Lightning's 3,
    measured after a fit), and on a busy machine those wakeups take the cores from the ranks' compute.
    One group per rank set is the same communication: the same ranks, in the same program order.

    torch's DeviceMesh creates its groups through ``new_group`` imported into
    ``torch.distributed.device_mesh`` (private; checked on torch 2.6-2.13); every rank asks for the same
    rank sets in the same order, so every rank reuses the same ones. Where torch splits an eagerly
    initialized NCCL communicator instead (``split_group``), nothing changes.
    """
    import torch.distributed.device_mesh as device_mesh

    create = getattr(device_mesh, "new_group", None)
    if create is None:
        yield
        return
    made: dict[tuple, Any] = {}

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                  **kwargs: Any) -> Any:
        rest = tuple(sorted((k, v) for k, v in kwargs.items() if k != "group_desc"))  # a name, not the group
        key = (tuple(ranks) if ranks is not None else None, timeout, backend, id(pg_options), rest)
        if key not in made:
            made[key] = create(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options, **kwargs)
        return made[key]

    device_mesh.new_group = new_group
    try:
        yield
    finally:
        device_mesh.new_group = create


def _gloo_devices(gloo: Any, default: Any) -> Any:
    """The default gloo group's devices, or None where ``default`` is no ``gloo`` group or this torch lacks any
    internal :func:`_singleton_groups_share_a_device` uses (``options._devices``, ``_Options`` with
    ``_devices``, ``_threads`` and ``_timeout``): then the one-rank groups stay torch's own."""
    if gloo is None or not isinstance(default, gloo) or not hasattr(gloo, "_Options"):
        return None
    devices = getattr(getattr(default, "options", None), "_devices", None)
    try:
        fields = dir(gloo._Options())
    except Exception:  # noqa: BLE001 -- an Options that cannot be built empty: not the internals known here
        return None
    return devices if devices and {"_devices", "_threads", "_timeout"} <= set(fields) else None


@contextlib.contextmanager
def _singleton_groups_share_a_device() -> Iterator[None]:
    """While meshkit builds its mesh, a one-rank gloo group uses the default group's gloo device, one worker thread.

    The size-1 axes (dp_replicate, pp, cp at dp_shard=2 x tp=2) share one group of this rank alone; torch
    gives it, as every gloo group, its own tcp device, whose event loop wakes every 10 ms idle or not, and 2
    worker threads: 3 threads and ~100 wakeups a second per rank that Lightning's 2-D mesh does not have. A
    one-rank context opens no connection, so the default group's device (which it never uses) serves it,
    and its collectives are local copies on one worker. Measured: a one-rank group adds 3 threads, 1 with this.

    torch builds gloo backends as ``ProcessGroupGloo(store, rank, size, timeout=...)`` in
    ``torch.distributed.distributed_c10d`` (private; checked on torch 2.6-2.13); only size-1 ones change.
    """
    import torch
    from torch.distributed import distributed_c10d as c10d

    gloo = getattr(c10d, "ProcessGroupGloo", None)
    try:
        default = c10d._get_default_group()._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):  # no default group, or no gloo backend for cpu tensors: nothing to share
        default = None
    devices = _gloo_devices(gloo, default)
    if devices is None:  # not gloo, or a torch without these internals: torch's own one-rank groups
        yield
        return

    class _OneRankSharedDevice(gloo):  # type: ignore[misc, valid-type]
        def __init__(self, store: Any, rank: int, size: int, timeout: Any = None) -> None:
            if size != 1:
                super().__init__(store, rank, size, *(() if timeout is None else (timeout,)))
                return
            options = gloo._Options()
            options._devices, options._threads = devices, 1
            if timeout is not None:
                options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = _OneRankSharedDevice
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = gloo


def _backend_with_timeout(timeout: "timedelta | None") -> "tuple[str, Any] | None":
    """``(backend, options)`` carrying ``timeout`` for DeviceMesh's ``backend_override`` (gloo or nccl), else None."""
    if timeout is None:
        return None
    import torch.distributed as dist

    backend = dist.get_backend()
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
    else:  # e.g. "cpu:gloo,cuda:nccl": torch applies its default timeout to sub-groups
        return None
    options._timeout = timeout
    return backend, options


def auto_nd_dims(model: Any, world_size: int, num_nodes: int, device: str, **kwargs: Any) -> ParallelDims:
    """The :class:`ParallelDims` ``strategy="auto_nd"`` trains with: the planner's pick for this world
    (:func:`meshkit.planner.auto_nd_layout`, which takes the same arguments and logs its table), as dims.

    Example::

        >>> from meshkit.models import LlamaConfig
        >>> auto_nd_dims(LlamaConfig.tiny(), world_size=4, num_nodes=1, device="cpu", seq_len=64).world_size
        4
    """
    from meshkit.planner import auto_nd_layout  # the planner (pure Python) sits below plugins/

    layout = auto_nd_layout(model, world_size, num_nodes, device, **kwargs)
    return ParallelDims(**layout.degrees, world_size=layout.world_size)
