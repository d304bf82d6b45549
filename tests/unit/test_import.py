"""``import meshkit`` is light (no torch, no Lightning) and still makes the strategy names work,
whichever of meshkit and Lightning is imported first (see meshkit/__init__.py for the mechanism)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

import meshkit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_MESHKIT_FIRST = """
import json, sys
import meshkit
assert "lightning" not in sys.modules
{first}
import lightning.pytorch as pl
trainer = pl.Trainer(strategy="hsdp_tp", accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
print(json.dumps({{"strategy": type(trainer.strategy).__qualname__,
                  "is_meshkit": type(trainer.strategy) is meshkit.NDParallelStrategy,
                  "hooks_left": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_RegisterAfterLightning"],
                  "loader_restored": type(sys.modules["lightning"].__loader__).__name__ != "_ThenRegister"}}))
"""


def _trainer_strategy(pl):
    trainer = pl.Trainer(strategy="hsdp_tp", accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return trainer.strategy


@pytest.mark.parametrize("first", ["pass", "meshkit.NDParallelStrategy", "meshkit.PRESETS"],
                         ids=["lightning_next", "plugins_next", "presets_next"])
def test_strategy_name_resolves_when_meshkit_is_imported_first(first):
    """The import hook, in a fresh process: Lightning imported by the user after meshkit, or by a meshkit
    module itself (then the hook waits for that module to finish: ``meshkit.PRESETS`` first, whose module
    imports Lightning, used to raise ImportError from a partially initialized meshkit.plugins.presets)."""
    out = subprocess.run([sys.executable, "-c", _MESHKIT_FIRST.format(first=first)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"strategy": "NDParallelStrategy", "is_meshkit": True, "hooks_left": [], "loader_restored": True}


def test_strategy_name_resolves_when_lightning_is_imported_first():
    """Lightning already loaded (this process): re-running ``meshkit/__init__`` registers at once."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    from meshkit.plugins.presets import PRESETS
    from meshkit.plugins.strategy import NDParallelStrategy

    saved = {name: StrategyRegistry.pop(name) for name in PRESETS}
    try:
        importlib.reload(meshkit)
        assert not [f for f in sys.meta_path if type(f).__name__ == "_RegisterAfterLightning"]
        assert type(_trainer_strategy(pl)) is NDParallelStrategy
        assert {name: StrategyRegistry[name]["init_params"] for name in PRESETS} == {n: {"preset": n} for n in PRESETS}
    finally:
        StrategyRegistry.update(saved)


def test_import_meshkit_imports_neither_torch_nor_lightning():
    # nor do the analysis modules, or `meshkit plan` (which reads peak FLOP/s from profiling's table)
    code = ("import contextlib, io, sys, meshkit; import meshkit.profiling.overlap, meshkit.timeline, meshkit.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = meshkit.cli.main(['plan', '--params', '8e9', '--layers', '32', '--hidden', '4096', '--heads',"
            " '32', '--gpus', '8', '--seq-len', '4096', '--global-batch', '64'])\n"
            "assert rc == 0, rc\n"
            "print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_public_names_are_lazy_and_listed():
    assert set(meshkit.__all__) <= set(dir(meshkit))
    for name in meshkit.__all__:
        assert getattr(meshkit, name) is not None, name
    from meshkit.plugins.strategy import NDParallelStrategy
    from meshkit.timeline import read_timeline

    assert meshkit.NDParallelStrategy is NDParallelStrategy and meshkit.read_timeline is read_timeline
    with pytest.raises(AttributeError, match="module 'meshkit' has no attribute 'no_such_name'"):
        meshkit.no_such_name


def test_one_lazy_loader_for_every_lazy_package():
    import meshkit.plugins
    import meshkit.profiling

    for pkg in (meshkit, meshkit.plugins, meshkit.profiling):
        assert pkg.__getattr__.__module__ == "meshkit.lazy", pkg.__name__
        assert set(pkg.__all__) <= set(dir(pkg)), pkg.__name__
        with pytest.raises(AttributeError, match=f"module '{pkg.__name__}' has no attribute 'no_such_name'"):
            pkg.no_such_name
    from meshkit.profiling.flops import peak_flops

    assert meshkit.profiling.peak_flops is peak_flops and "peak_flops" in vars(meshkit.profiling)  # cached
    assert meshkit.plugins.dims.__name__ == "meshkit.plugins.dims"  # a submodule by attribute
