"""NDParallelOptions: the one record of both front doors' settings (issue 28: the Trainer's and Fabric's
constructors were two copies of one signature). Both strategies take the same keywords or an options object,
validate them once, expose ``strategy.options``; Fabric refuses what only the Trainer runs."""

from __future__ import annotations

import dataclasses
import inspect
import re
from datetime import timedelta

import pytest

import meshkit
from meshkit.plugins.options import FABRIC_UNSUPPORTED, NDParallelOptions

FRONT_DOORS = [meshkit.NDParallelStrategy, meshkit.NDParallelFabricStrategy]
FIELDS = [f.name for f in dataclasses.fields(NDParallelOptions) if f.name != "owner"]


@pytest.mark.parametrize("cls", FRONT_DOORS, ids=lambda c: c.__name__)
def test_the_keywords_are_the_options_fields(cls):
    params = inspect.signature(cls).parameters
    assert list(params) == ["preset", "options", *FIELDS[1:]]
    defaults = {f.name: f.default for f in dataclasses.fields(NDParallelOptions)}
    assert all(params[n].default == defaults[n] for n in FIELDS[1:])


@pytest.mark.parametrize("cls", FRONT_DOORS, ids=lambda c: c.__name__)
def test_keywords_and_an_options_object_build_the_same_strategy(cls):
    settings = dict(dp_shard=2, tp=2, sequence_parallel=True, activation_checkpointing="selective",
                    global_batch_size=8, timeout=timedelta(minutes=3), allow_unverified=True)
    by_keywords = cls("fsdp2", **settings)
    by_options = cls(options=NDParallelOptions("fsdp2", **settings))
    assert by_keywords.options == by_options.options and by_keywords.options.owner == cls.__name__
    assert by_keywords.preset is meshkit.PRESETS["fsdp2"] and by_keywords.options.preset is meshkit.PRESETS["fsdp2"]
    assert by_keywords.parallel_config == by_options.parallel_config
    assert by_keywords.parallel_config.activation_checkpointing == "selective"
    assert by_keywords.options.sizes == {"dp_replicate": "auto", "dp_shard": 2, "pp": "auto", "cp": "auto", "tp": 2}
    assert by_keywords._timeout == timedelta(minutes=3)  # handed to Lightning's process-group start
    # keywords override the options object's fields; the preset argument overrides options.preset
    over = cls("hsdp", options=by_options.options, tp=1)
    assert (over.preset.name, over.options.tp, over.options.dp_shard) == ("hsdp", 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        over.options.tp = 4  # type: ignore[misc]


def test_one_options_object_serves_both_front_doors():
    opts = NDParallelOptions(dp_shard=2, tp=2, compile=True)
    trainer, fabric = meshkit.NDParallelStrategy(options=opts), meshkit.NDParallelFabricStrategy(options=opts)
    assert trainer.options == fabric.options == opts
    assert (trainer.options.owner, fabric.options.owner) == ("NDParallelStrategy", "NDParallelFabricStrategy")
    assert trainer.parallel_config == fabric.parallel_config and trainer.parallel_config.compile


@pytest.mark.parametrize("cls", FRONT_DOORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("settings, match", [
    (dict(timeout=0), r"`timeout=0` must be a positive `datetime.timedelta`"),
    (dict(allow_unverified="yes"), r"`allow_unverified='yes'` must be True or False"),
    (dict(activation_checkpointing="partial"), r"`activation_checkpointing='partial'`"),
    (dict(pp_microbatches=0), r"`pp_microbatches=0` must be a positive int"),
    (dict(pp_schedule="1f1b", pp_virtual_stages=2), r"`pp_virtual_stages=2` needs a multi-stage schedule"),
], ids=["timeout", "allow_unverified", "ac", "microbatches", "virtual_stages"])
def test_each_front_door_refuses_a_bad_setting_naming_itself(cls, settings, match):
    with pytest.raises(ValueError, match=match) as info:
        cls(**settings)
    if "timeout" in settings or "allow_unverified" in settings:  # checked by the options: the class the user called
        assert str(info.value).startswith(f"{cls.__name__}: ")


@pytest.mark.parametrize("cls", FRONT_DOORS, ids=lambda c: c.__name__)
def test_an_unknown_keyword_names_the_closest_field(cls):
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) got an unexpected keyword argument 'tp_pan' \(did you "
                                        r"mean `tp_plan`\?\)"):
        cls(tp_pan={"*": "colwise"})
    with pytest.raises(TypeError, match=r"`options=` takes an NDParallelOptions, got dict"):
        cls(options={"tp": 2})


@pytest.mark.parametrize("name", sorted(FABRIC_UNSUPPORTED))
def test_fabric_refuses_what_only_the_trainer_runs_and_the_trainer_takes_it(name):
    value = {"loss_parallel": True, "save_distributed_checkpoint": False, "cp_attention": "ulysses",
             "cp_layout": "contiguous", "pp_schedule": "gpipe", "pp_microbatches": 4, "pp_virtual_stages": 2,
             "pp_split_points": [2], "pp_timeline_dir": "/tmp/timeline"}[name]
    settings = {name: value, **({"pp_schedule": "interleaved_1f1b"} if name == "pp_virtual_stages" else {})}
    with pytest.raises(ValueError, match=rf"NDParallelFabricStrategy: .*`{re.escape(f'{name}={value!r}')}`.* not supported under "
                                         r"Fabric .*L.Trainer\(strategy=NDParallelStrategy\(...\)\)"):
        meshkit.NDParallelFabricStrategy(**settings)
    assert getattr(meshkit.NDParallelStrategy(**settings).options, name) == value  # the fix the message names
