"""Every bad input a new user may give, in one process: each fails clearly (an error naming `name=value`,
the rule and a fix) or, where the layout is legal but wasteful, warns. No process group, no hang.

Each case is (id, call, expectation): ``call(tmp_path)`` runs the input; the expectation is
``raises(Type, pattern)`` or ``warns(pattern)``. docs/checkpoints.md has the before/after table.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import meshkit
from meshkit.models.llama import LlamaConfig, LlamaLM
from meshkit.plugins.checkpoint import (
    CheckpointError,
    UnsafeCheckpointError,
    check_fits,
    consolidate_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.parallelize import ParallelConfig
from meshkit.plugins.presets import PRESETS, check_launch, resolve_layout

AUTO = dict.fromkeys(("dp_replicate", "dp_shard", "pp", "cp", "tp"), "auto")


def raises(kind: type, pattern: str) -> tuple:
    return ("raises", kind, pattern)


def warns(pattern: str) -> tuple:
    return ("warns", None, pattern)


def _lm(**overrides: Any) -> nn.Module:
    return LlamaLM(LlamaConfig.tiny(**overrides))


class _WithConfigureModel(LlamaLM):  # a LightningModule that parallelizes its model itself
    def __init__(self) -> None:
        super().__init__(LlamaConfig.tiny())

    def configure_model(self) -> None:
        pass


class _Flat(nn.Module):  # no repeated blocks
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)


def _layout(preset: str = "hsdp_tp", world: int = 4, nodes: int = 1, model: Any = None, **kw: Any) -> Callable:
    sizes = {**AUTO, **{k: v for k, v in kw.items() if k in AUTO}}
    config = ParallelConfig(**{k: v for k, v in kw.items() if k not in AUTO})
    return lambda tmp: resolve_layout(PRESETS[preset], sizes, config, world_size=world, num_nodes=nodes,
                                      model=model() if callable(model) else model)


def _strategy(**kw: Any) -> Callable:
    return lambda tmp: meshkit.NDParallelStrategy(**kw)


def _dims(**kw: Any) -> Callable:
    return lambda tmp: ParallelDims(**kw)


def _dims_call(kw: dict, method: str, *args: Any) -> Callable:
    return lambda tmp: getattr(ParallelDims(**kw), method)(*args)


def _launch(devices: int, nodes: int, env: dict, initialized: int | None = None) -> Callable:
    return lambda tmp: check_launch(devices, nodes, env, initialized)


# ---- checkpoints on disk (one process) --------------------------------------------------------------
def _good(tmp: Path, name: str = "good.ckpt") -> Path:
    """A meshkit checkpoint written by save_checkpoint in one process: a 2-layer state and SGD-like entries."""
    torch.manual_seed(0)
    state = {"layers.0.w": torch.randn(4, 4), "layers.1.w": torch.randn(4, 4)}
    optim = {"state.layers.0.w.momentum_buffer": torch.zeros(4, 4), "param_groups.layers.0.w.lr": 0.1}
    path = tmp / name
    save_checkpoint(path, state, [optim], {"global_step": 3})
    return path


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    def __reduce__(self):
        return (eval, ("1 + 1",))


def _rehash(ckpt: Path, name: str) -> None:
    manifest = json.loads((ckpt / "meshkit.json").read_text())
    data = (ckpt / name).read_bytes()
    manifest["files"][name].update(bytes=len(data), crc32=f"{zlib.crc32(data):08x}")
    (ckpt / "meshkit.json").write_text(json.dumps(manifest))


def _damaged(edit: Callable[[Path], None], then: Callable[[Path], Any] = consolidate_checkpoint) -> Callable:
    def run(tmp: Path) -> Any:
        ckpt = _good(tmp)
        edit(ckpt)
        return then(ckpt)

    return run


def _flip(ckpt: Path) -> None:
    f = ckpt / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def _truncate(ckpt: Path) -> None:
    f = ckpt / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-7])


def _metadata(obj: Any, rehash: bool = True) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        (ckpt / ".metadata").write_bytes(obj if isinstance(obj, bytes) else pickle.dumps(obj))
        if rehash:
            _rehash(ckpt, ".metadata")

    return edit


def _meta(obj: Any) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        torch.save({"global_step": 1, "x": obj}, ckpt / "meta.pt")
        _rehash(ckpt, "meta.pt")

    return edit


def _manifest(text: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt / "meshkit.json").write_text(text)


def _crafted_entry(tmp: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    marker = tmp / "pwned"
    state = {"state_dict": {"w": torch.ones(2)}, "optimizer_0": {"param_groups.w.lr": _Payload(marker)}}
    dcp.save(state, checkpoint_id=tmp / "crafted", no_dist=True)
    torch.save({}, tmp / "crafted" / "meta.pt")  # no manifest: what an older meshkit wrote
    try:
        return consolidate_checkpoint(tmp / "crafted", allow_unverified=True)  # the opt-in reads; the reader refuses
    finally:
        assert not marker.exists(), "the payload ran"


def _resume_check(ckpt: Path) -> Any:
    """What a resume checks before any weight (no module: a load past the checks would fail otherwise)."""
    return load_checkpoint(ckpt, None)


def _fits(model_state: dict, strict: bool = True) -> Callable:
    return lambda tmp: check_fits(model_state, _good(tmp), strict=strict)


def _full_file(obj: Any, raw: bytes | None = None) -> Callable:
    def run(tmp: Path) -> Any:
        f = tmp / "weights.pt"
        if raw is not None:
            f.write_bytes(raw)
        else:
            torch.save(obj, f)
        # a file without a sidecar needs the opt-in; no module: reaching the loader would fail otherwise
        return load_checkpoint(f, None, allow_unverified=True)

    return run


def _entry(name: str, **change: Any) -> Callable[[Path], None]:
    """Garble one manifest entry: ``change`` its keys (None: delete the key)."""
    def edit(ckpt: Path) -> None:
        manifest = json.loads((ckpt / "meshkit.json").read_text())
        entry = manifest["files"][name]
        for key, value in change.items():
            entry.pop(key) if value is None else entry.__setitem__(key, value)
        (ckpt / "meshkit.json").write_text(json.dumps(manifest))

    return edit


def _sibling(suffix: str, then: Callable[[Path], Any]) -> Callable:
    """A save's temporary folder (``.good.ckpt.partial`` / ``.old``): a complete copy under the hidden name."""
    def run(tmp: Path) -> Any:
        ckpt = _good(tmp)
        hidden = ckpt.with_name(f".{ckpt.name}{suffix}")
        ckpt.rename(hidden)
        return then(hidden)

    return run


def _unverified_export(tmp: Path) -> Any:
    """consolidate --allow-unverified, then load_weights without the opt-in."""
    from meshkit.plugins.checkpoint import load_weights

    ckpt = _good(tmp)
    (ckpt / "meshkit.json").unlink()
    consolidate_checkpoint(ckpt, tmp / "model.pt", allow_unverified=True)
    return load_weights(tmp / "model.pt")


def _cli(*argv: str) -> Callable:
    def run(tmp: Path) -> Any:
        from meshkit.cli import main

        code = main([a.replace("TMP", str(tmp)) for a in argv])
        if code != 2:
            raise AssertionError(f"exit {code}")
        raise SystemExit(code)

    return run


_FOUR = {"layers.0.w": torch.zeros(4, 4), "layers.1.w": torch.zeros(4, 4)}

CASES: list[tuple[str, Callable, tuple]] = [
    # -- strategy arguments (raise in __init__) --
    ("preset_typo", _strategy(preset="hsdp-tp"), raises(ValueError, r"unknown `preset='hsdp-tp'`")),
    ("preset_empty", _strategy(preset=""), raises(ValueError, r"unknown `preset=''`")),
    ("ac_mode", _strategy(activation_checkpointing="partial"), raises(ValueError, r"`activation_checkpointing='partial'`")),
    ("ac_bool", _strategy(activation_checkpointing=True), raises(ValueError, r"`activation_checkpointing=True`")),
    ("cp_attention", _strategy(cp_attention="flash"), raises(ValueError, r"`cp_attention='flash'`")),
    ("cp_layout", _strategy(cp_layout="zigzag"), raises(ValueError, r"`cp_layout='zigzag'`")),
    # -- issue 27 item 9: timeout=20 was a raw error; timeout=0 blamed ranks that were there --
    ("timeout_int", _strategy(timeout=20),
     raises(ValueError, r"`timeout=20` must be a positive `datetime.timedelta` .* e.g. `timeout=timedelta\(seconds=20\)`")),
    ("timeout_0", _strategy(timeout=0), raises(ValueError, r"`timeout=0` must be .* 0 would fail every collective")),
    ("timeout_zero_delta", _strategy(timeout=__import__("datetime").timedelta(0)),
     raises(ValueError, r"`timeout=datetime.timedelta\(0\)` must be a positive")),
    ("timeout_str", _strategy(timeout="20s"), raises(ValueError, r"`timeout='20s'` must be a positive")),
    # -- sizes --
    ("tp_0", _layout(tp=0), raises(ValueError, r"`tp=0` must be a positive int")),
    ("tp_neg", _layout(tp=-1), raises(ValueError, r"`tp=-1` must be a positive int")),
    ("tp_float", _layout(tp=2.5), raises(ValueError, r"`tp=2.5` must be a positive int")),
    ("tp_str", _layout(tp="2"), raises(ValueError, r"`tp='2'` must be a positive int")),
    ("tp_bool", _layout(tp=True), raises(ValueError, r"`tp=True` must be a positive int")),
    ("dp_shard_0", _layout(dp_shard=0), raises(ValueError, r"`dp_shard=0` must be a positive int")),
    ("dp_shard_-2", _layout(dp_shard=-2), raises(ValueError, r"`dp_shard=-2` must be a positive int")),
    ("dp_replicate_0", _layout(dp_replicate=0), raises(ValueError, r"`dp_replicate=0` must be a positive int")),
    ("pp_0", _layout(pp=0), raises(ValueError, r"`pp=0` must be a positive int")),
    ("cp_neg", _layout(cp=-1), raises(ValueError, r"`cp=-1` must be a positive int")),
    ("cp_word", _layout(cp="max"), raises(ValueError, r"`cp='max'` must be a positive int")),
    ("nodes_not_dividing", _layout(world=6, nodes=4), raises(ValueError, r"world size 6 is not divisible by `num_nodes=4`")),
    ("product_mismatch", _layout(dp_shard=3, tp=2), raises(ValueError, r"multiplied \(6\) should equal the world size \(4\)")),
    ("fill_not_dividing", _layout(tp=3), raises(ValueError, r"does not divide the world size \(4\)")),
    ("tp_vs_heads", _layout(world=3, tp=3, model=_lm), raises(ValueError, r"`tp=3` must divide the model's")),
    ("tp_vs_kv_heads", _layout(tp=4, model=_lm), raises(ValueError, r"`num_kv_heads=2`")),
    ("ulysses_heads", _layout(preset="cp", cp=4, tp=1, cp_attention="ulysses", model=lambda: _lm(n_heads=2, n_kv_heads=2)),
     raises(ValueError, r"ulysses")),
    ("pp_with_cp", _layout(preset="pp", cp=2), raises(ValueError, r"`pp=2` with `cp=2` is not supported")),
    # -- global batch --
    ("gbs_0", _layout(global_batch_size=0), raises(ValueError, r"`global_batch_size=0` must be a positive int")),
    ("gbs_neg", _layout(global_batch_size=-8), raises(ValueError, r"`global_batch_size=-8` must be a positive int")),
    ("gbs_str", _layout(global_batch_size="8"), raises(ValueError, r"`global_batch_size='8'` must be a positive int")),
    ("gbs_float", _layout(global_batch_size=8.0), raises(ValueError, r"`global_batch_size=8.0` must be a positive int")),
    ("gbs_bool", _layout(global_batch_size=True), raises(ValueError, r"`global_batch_size=True` must be a positive int")),
    ("gbs_not_divisible", _layout(preset="fsdp2", global_batch_size=6),
     raises(ValueError, r"`global_batch_size=6` is not divisible")),
    # -- issue 27 item 4: a declared global batch against what a step trains on; loss_parallel without tp --
    ("gbs_vs_loader", _dims_call(dict(dp_shard=4, world_size=4), "check_step_batch", 32, 2, 2),
     raises(ValueError, r"`global_batch_size=32` but a step trains on 16 sequences: batch 2 per rank x "
                        r"`dp_replicate\*dp_shard=4` x `accumulate_grad_batches=2`. Use a DataLoader `batch_size=4`")),
    ("gbs_vs_loader_odd", _dims_call(dict(dp_shard=4, world_size=4), "check_step_batch", 36, 2, 2),
     raises(ValueError, r"Use a DataLoader batch size that fits, or `global_batch_size=16`")),
    ("loss_parallel_no_tp", _layout(preset="fsdp2", loss_parallel=True),
     raises(ValueError, r"`loss_parallel=True` needs tensor parallelism, but `tp=1`")),
    # -- precision --
    ("precision_16", _layout(precision="16-mixed"), raises(ValueError, r"16-mixed")),
    ("precision_fp8", _layout(precision="fp8"), raises(ValueError, r"fp8")),
    ("precision_64", _layout(precision="64-true"), raises(ValueError, r"64-true")),
    ("precision_bf16", _layout(precision="bf16"), raises(ValueError, r"bf16")),
    # -- tp plan --
    ("tp_plan_no_match", _layout(tp=2, tp_plan={"layers.*.attention.wq": "colwise"}, model=_lm),
     raises(ValueError, r"pattern\(s\) \['layers.\*.attention.wq'\] match no module")),
    ("tp_plan_typo", _layout(tp=2, tp_plan={"model.layers.*.attn.wq": "rowwise"}, model=_lm),
     raises(ValueError, r"match no module")),
    ("tp_plan_style", _layout(tp=2, tp_plan={"model.layers.*.attention.wq": "diagonal"}, model=_lm),
     raises(ValueError, r"`model.layers.\*.attention.wq='diagonal'` is not a ParallelStyle")),
    ("tp_plan_style_int", _layout(tp=2, tp_plan={"model.output": 3}, model=_lm),
     raises(ValueError, r"`model.output=3` is not a ParallelStyle")),
    ("tp_plan_list", _layout(tp=2, tp_plan=["model.output"], model=_lm), raises(ValueError, r"must be a dict")),
    # issue 27 item 2 under pp: a configure_model's model is never split into stages
    ("pp_configure_model", _layout(preset="pp", model=_WithConfigureModel),
     raises(ValueError, r"`pp=2` with a `configure_model` in _WithConfigureModel: meshkit cuts pipeline stages only "
                        r"when it parallelizes the model itself.* or use `pp=1`")),
    ("tp_plan_unused", _layout(preset="fsdp2", tp_plan={"model.output": "colwise"}, model=_lm),
     warns(r"`tp_plan` is given but `tp=1`")),
    # -- legal but wasteful: warnings --
    ("no_repeated_blocks", _layout(preset="fsdp2", model=_Flat), warns(r"has no repeated blocks")),
    ("hsdp_tp_devices3", _layout(world=3, model=_lm), warns(r"preset `hsdp_tp` turns tensor parallelism on")),
    ("tp_devices3_nodes2", _layout(world=6, nodes=2, model=_lm), warns(r"preset `hsdp_tp` turns tensor parallelism on")),
    ("tp_straddles_nodes", _layout(preset="fsdp2", world=6, nodes=2, tp=2, model=_lm), warns(r"span two nodes")),
    ("tp_larger_than_node", _layout(preset="fsdp2", world=8, nodes=4, tp=4), warns(r"larger than the 2 devices")),
    # -- ParallelDims directly --
    ("dims_order", _dims(order=("tp", "dp"), world_size=1), raises(ValueError, r"must be a permutation")),
    ("dims_world_0", _dims(world_size=0), raises(ValueError, r"`world_size=0` must be >= 1")),
    ("dims_str", _dims(dp_replicate="x"), raises(ValueError, r"`dp_replicate='x'` must be an int")),
    ("dims_bool", _dims(tp=True), raises(ValueError, r"`tp=True` must be an int")),
    # -- launcher vs Trainer (before any collective) --
    ("launch_world_big", _launch(2, 1, {"WORLD_SIZE": "4"}), raises(ValueError, r"`WORLD_SIZE=4` processes but")),
    ("launch_world_small", _launch(2, 1, {"WORLD_SIZE": "1"}), raises(ValueError, r"`WORLD_SIZE=1` processes but")),
    ("launch_nodes", _launch(2, 2, {"WORLD_SIZE": "2"}), raises(ValueError, r"`num_nodes=2` = 4")),
    # issue 27 item 9, a stale process group: "the launcher started `WORLD_SIZE=4`" blamed a launcher that set nothing
    ("launch_initialized", _launch(2, 1, {}, 4),
     raises(ValueError, r"this process already holds a process group of 4 rank\(s\) \(an earlier fit's, or an "
                        r"`init_process_group` of your own\), but the Trainer has `devices=2` × `num_nodes=1` = 2: that "
                        r"group is stale. Call `torch.distributed.destroy_process_group\(\)` on every rank")),
    ("launch_initialized_vs_launcher", _launch(2, 1, {"WORLD_SIZE": "2"}, 4),
     raises(ValueError, r"holds a process group of 4 rank\(s\) .* and the launcher started `WORLD_SIZE=2`: that group is stale")),
    ("launch_local_rank", _launch(2, 1, {"LOCAL_RANK": "2"}), raises(ValueError, r"`LOCAL_RANK=2`")),
    ("launch_node_rank", _launch(2, 1, {"NODE_RANK": "1"}), raises(ValueError, r"`NODE_RANK=1`")),
    ("launch_rank", _launch(2, 2, {"RANK": "1", "LOCAL_RANK": "1", "NODE_RANK": "1"}),
     raises(ValueError, r"`RANK=1` is not")),
    ("launch_not_int", _launch(2, 1, {"WORLD_SIZE": "four"}), raises(ValueError, r"`WORLD_SIZE='four'`")),
    ("launch_negative", _launch(2, 1, {"LOCAL_RANK": "-1"}), raises(ValueError, r"`LOCAL_RANK='-1'`")),
    # -- checkpoint folders --
    ("consolidate_missing", lambda tmp: consolidate_checkpoint(tmp / "nope"), raises(ValueError, r"it does not exist")),
    ("consolidate_file", lambda tmp: consolidate_checkpoint(Path(__file__)), raises(ValueError, r"not a sharded")),
    ("consolidate_empty_dir", lambda tmp: consolidate_checkpoint(tmp), raises(ValueError, r"has no `.metadata` file")),
    ("ckpt_incomplete", _damaged(lambda c: [(c / "meshkit.json").unlink(), (c / "meta.pt").unlink()]),
     raises(CheckpointError, r"a save was interrupted")),
    ("ckpt_flipped_byte", _damaged(_flip), raises(CheckpointError, r"`__0_0.distcp` \(written by rank 0\) fails its crc32")),
    ("ckpt_truncated", _damaged(_truncate), raises(CheckpointError, r"`__0_0.distcp` \(written by rank 0\) has \d+ bytes")),
    ("ckpt_shard_missing", _damaged(lambda c: (c / "__0_0.distcp").unlink()),
     raises(CheckpointError, r"`__0_0.distcp` \(written by rank 0\) is missing")),
    ("ckpt_meta_flipped", _damaged(lambda c: (c / "meta.pt").write_bytes(b"x" + (c / "meta.pt").read_bytes()[1:])),
     raises(CheckpointError, r"`meta.pt` .* fails its crc32")),
    ("manifest_not_json", _damaged(_manifest("{not json")), raises(CheckpointError, r"`meshkit.json` is unreadable")),
    ("manifest_no_files", _damaged(_manifest('{"hash": "crc32"}')), raises(CheckpointError, r"is unreadable")),
    ("manifest_other_hash", _damaged(_manifest('{"hash": "md5", "files": {}}')), raises(CheckpointError, r"uses hash `md5`")),
    # -- issue 27 item 5: a lost manifest switched every check off; 6: a garbled entry was a raw KeyError --
    ("ckpt_no_manifest", _damaged(lambda c: (c / "meshkit.json").unlink()),
     raises(CheckpointError, r"it has no `meshkit.json`, so none of its files can be checked .* `allow_unverified=True`")),
    ("ckpt_no_manifest_flipped", _damaged(lambda c: [(c / "meshkit.json").unlink(), _flip(c)], _resume_check),
     raises(CheckpointError, r"has no `meshkit.json`.*NDParallelStrategy\(allow_unverified=True\)")),
    ("manifest_entry_no_crc32", _damaged(_entry("__0_0.distcp", crc32=None)),
     raises(CheckpointError, r"`meshkit.json` is garbled: its entry `__0_0.distcp` has no `crc32`")),
    ("manifest_entry_no_rank", _damaged(_entry("meta.pt", rank=None), _resume_check),
     raises(CheckpointError, r"is garbled: its entry `meta.pt` has no `rank`")),
    ("manifest_entry_bytes_str", _damaged(_entry(".metadata", bytes="12")),
     raises(CheckpointError, r"entry `.metadata` has `bytes='12'`")),
    ("manifest_entry_crc_int", _damaged(_entry(".metadata", crc32=12)), raises(CheckpointError, r"has `crc32=12`")),
    ("manifest_entry_list", _damaged(_manifest('{"hash": "crc32", "files": {"meta.pt": [1, 2]}}')),
     raises(CheckpointError, r"entry `meta.pt` is a list, not a dict")),
    ("manifest_entry_path", _damaged(_manifest('{"hash": "crc32", "files": {"../x": {}}}')),
     raises(CheckpointError, r"names the file '../x'")),
    ("ckpt_path_partial_folder", _sibling(".partial", lambda c: load_checkpoint(c, None)),
     raises(CheckpointError, r"`ckpt_path='.*/.good.ckpt.partial'` is meshkit's temporary unfinished copy of a save "
                             r"to `good.ckpt`, not a checkpoint. Pass `.*/good.ckpt`")),
    ("ckpt_path_old_folder", _sibling(".old", lambda c: load_checkpoint(c, None)),
     raises(CheckpointError, r"temporary previous copy, kept only while it publishes")),
    ("consolidate_partial_folder", _sibling(".partial", consolidate_checkpoint),
     raises(CheckpointError, r"is meshkit's temporary unfinished copy of a save to `good.ckpt`")),
    ("load_weights_no_sidecar", lambda tmp: __import__("meshkit.plugins.checkpoint", fromlist=["x"]).load_weights(
        (torch.save({"w": torch.ones(1)}, tmp / "w.pt"), tmp / "w.pt")[1]),
     raises(CheckpointError, r"`.*w.pt` cannot be verified: it has no `w.pt.meshkit.json`.*allow_unverified=True")),
    ("ckpt_path_no_sidecar", lambda tmp: load_checkpoint((torch.save({"state_dict": {}}, tmp / "l.ckpt"),
                                                          tmp / "l.ckpt")[1], None),
     raises(CheckpointError, r"cannot be verified: it has no `l.ckpt.meshkit.json`")),
    ("load_unverified_export", _unverified_export,
     raises(CheckpointError, r"says it was consolidated from an unverified checkpoint \(`.*good.ckpt` had no manifest\)")),
    ("strategy_allow_unverified_str", _strategy(allow_unverified="yes"),
     raises(ValueError, r"`allow_unverified='yes'` must be True or False")),
    ("metadata_system", _damaged(_metadata(_Payload(Path("/tmp/meshkit-test-pwned")))),
     raises(UnsafeCheckpointError, r"refused to unpickle `posix.system`")),
    ("metadata_eval", _damaged(_metadata(_Eval())), raises(UnsafeCheckpointError, r"refused to unpickle `builtins.eval`")),
    ("metadata_dict", _damaged(_metadata({"a": 1})), raises(UnsafeCheckpointError, r"holds a dict, not DCP `Metadata`")),
    ("metadata_truncated", _damaged(_metadata(b"\x80\x04\x95")), raises(UnsafeCheckpointError, r"not a readable DCP metadata")),
    ("metadata_empty", _damaged(_metadata(b"")), raises(UnsafeCheckpointError, r"not a readable DCP metadata")),
    ("metadata_unhashed", _damaged(_metadata(_Eval(), rehash=False)), raises(CheckpointError, r"`.metadata` \(written by rank 0\) has \d+ bytes")),
    ("shard_entry_payload", _crafted_entry, raises(UnsafeCheckpointError, r"refused the non-tensor entry")),
    ("verify_missing", lambda tmp: verify_checkpoint(tmp / "nope"), raises(CheckpointError, r"it is not a folder")),
    ("verify_file", lambda tmp: verify_checkpoint(Path(__file__)), raises(CheckpointError, r"it is not a folder")),
    # -- strict resume --
    ("fits_missing", _fits({**_FOUR, "layers.2.w": torch.zeros(4, 4)}),
     raises(CheckpointError, r"1 key\(s\) missing from the checkpoint: \['layers.2.w'\]")),
    ("fits_unexpected", _fits({"layers.0.w": torch.zeros(4, 4)}),
     raises(CheckpointError, r"1 unexpected key\(s\) in the checkpoint: \['layers.1.w'\]")),
    ("fits_shape", _fits({**_FOUR, "layers.1.w": torch.zeros(4, 8)}),
     raises(CheckpointError, r"`layers.1.w`: checkpoint \(4, 4\), model \(4, 8\)")),
    ("fits_shape_not_strict", _fits({"layers.0.w": torch.zeros(2, 4)}, strict=False),
     raises(CheckpointError, r"shape mismatch")),
    # -- ckpt_path that is one file --
    ("ckpt_path_plain_state_dict", _full_file({"w": torch.ones(2)}), raises(CheckpointError, r"not a Lightning checkpoint")),
    ("ckpt_path_list", _full_file([torch.ones(2)]), raises(CheckpointError, r"is a list, not a Lightning checkpoint")),
    ("ckpt_path_tensor", _full_file(torch.ones(2)), raises(CheckpointError, r"is a Tensor, not a Lightning")),
    ("ckpt_path_text", _full_file(None, raw=b"hello"), raises(CheckpointError, r"not a readable torch file")),
    ("ckpt_path_payload", _full_file(None, raw=pickle.dumps(_Eval())), raises(CheckpointError, r"not a readable torch")),
    # -- item 9: torch's advice to re-run with weights_only=False (it runs the payload) is not passed on --
    ("ckpt_path_pickled_global", _full_file({"state_dict": {}, "x": _Payload(Path("/tmp/meshkit-test-pwned"))}),
     raises(UnsafeCheckpointError, r"(?s)^(?!.*likely succeed)(?!.*weights_only=False\)`? will).*unsupported GLOBAL "
                                   r"posix.system.*add_safe_globals")),
    ("meta_pickled_global", _damaged(_meta(_Payload(Path("/tmp/meshkit-test-pwned"))), _resume_check),
     raises(UnsafeCheckpointError, r"(?s)^(?!.*likely succeed)`.*meta.pt` holds an object outside torch's "
                                   r"weights_only allowlist \(unsupported GLOBAL posix.system")),
    ("ckpt_path_missing", lambda tmp: load_checkpoint(tmp / "nope.ckpt", None),
     raises(CheckpointError, r"does not exist")),
    # -- CLI --
    ("cli_consolidate_missing", _cli("consolidate", "TMP/nope", "TMP/out.pt"), raises(SystemExit, r"2")),
    ("cli_consolidate_corrupt", lambda tmp: _cli("consolidate", str(_damaged(_flip, lambda c: c)(tmp)), "TMP/o.pt")(tmp),
     raises(SystemExit, r"2")),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_clearly(case, tmp_path, capsys):
    _, call, (how, kind, pattern) = case
    if how == "raises":
        with pytest.raises(kind, match=pattern):
            call(tmp_path)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(tmp_path)
    assert any(__import__("re").search(pattern, str(w.message)) for w in caught), [str(w.message) for w in caught]


def test_cli_errors_go_to_stderr(tmp_path, capsys):
    from meshkit.cli import main

    assert main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "o.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshkit consolidate: error: ") and "does not exist" in err


def test_enough_inputs():
    assert len(CASES) >= 80


def test_good_checkpoint_round_trips(tmp_path):
    ckpt = _good(tmp_path)
    verify_checkpoint(ckpt)
    check_fits(dict(_FOUR), ckpt)
    weights = consolidate_checkpoint(ckpt)
    assert set(weights) == set(_FOUR)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.ckpt"]  # no .partial / .old left


_PLAN = ["plan", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "4096",
         "--global-batch", "64", "--nodes", "1", "--gpus-per-node", "8"]


@pytest.mark.parametrize("argv, match", [
    ([*_PLAN, "--max-tp", "0"], "`max_tp=0` must be an int >= 1"),
    ([*_PLAN, "--max-tp", "-3"], "`max_tp=-3` must be an int >= 1"),
    ([*_PLAN, "--max-pp", "0"], "`max_pp=0` must be an int >= 1"),
    (["analyze", ".", "--min-lateness-ms", "-5"], "`min_lateness_ms=-5.0` must be a number >= 0"),
])
def test_cli_rejects_bad_numbers(argv, match, capsys):
    # Issue 14 item 10: these were accepted ("0 of 0 layouts fit", a cap silently lifted, a negative floor).
    from meshkit.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"meshkit {argv[0]}: error:" in err and match in err, err
