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

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "AXES", "Degree", "LIGHTNING_ALIASES"]

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
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=order, backend_override=override)
    # Flattened axes, kept here rather than sliced from the root again (torch deprecates that).
    # DeviceMesh._flatten is private; checked on torch 2.6-2.13.
    flat = {
        "dp": mesh[("dp_replicate", "dp_shard")]._flatten("dp", backend_override=backend),
        "dp_shard_cp": mesh[("dp_shard", "cp")]._flatten("dp_shard_cp", backend_override=backend),
        "dp_cp": mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp", backend_override=backend),
    }
    for alias, axes in LIGHTNING_ALIASES.items():  # registered on the root: mesh["tensor_parallel"] works
        mesh[axes]._flatten(alias)
    return mesh, flat


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
