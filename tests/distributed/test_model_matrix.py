"""Same computation, rearranged: HF model families × presets on 4 gloo processes against one process.

Every cell compares the losses AND the final parameters of every name (update error
max|dist-ref| / max|ref-init| <= 1e-6 in float64, the same names as one process), and checks that TP peers
hold identical replicated parameters after training. A family the automatic TP plan refuses
(fused or Conv1D projections) must name the modules and suggest a plan; the test applies that
plan and checks it too ("refused with a tested fix").
"""

from __future__ import annotations

import re

import pytest
import torch

from meshkit.plugins.tensor_parallel import infer_tp_plan
from tests.dist_pool import ProcessPool
from tests.distributed import hf_models as H
from tests.distributed import training as T

STEPS = 6
MAX_UPDATE_ERROR = 1e-6
"""In float64 (hf_models.DTYPE, the families' own float32 steps too: hf_models.Float64Math) a correct layout lands
at 1e-12..1e-15 on every family; a wrong gradient at lr 2 is >= 1e-2. The limit sits between."""
MAX_LOSS_RTOL = 1e-6
PRESETS = {"fsdp2": dict(dp_shard=4, tp=1), "hsdp_tp": dict(dp_shard=2, tp=2)}
REFUSED_UNDER_TP = {"gpt2": "Conv1D", "phi3": "qkv_proj"}
"""Families whose projections the automatic plan cannot shard, and a word the refusal must name."""


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4) as p:
        yield p


def _check_matches_one_process(
    family: str, results: list[dict], loss_form: str = "ce", overrides: dict | None = None, cell: str = ""
) -> None:
    want_losses, init, want = H.reference(family, STEPS, results[0]["dp_size"], loss_form=loss_form, overrides=overrides)
    got_losses = torch.tensor(T.global_losses(results), dtype=torch.float64)
    torch.testing.assert_close(got_losses, torch.tensor(want_losses, dtype=torch.float64), rtol=MAX_LOSS_RTOL, atol=0)
    errors = H.update_errors(H.merged_params(results), init, want)
    worst = max(errors, key=errors.get)
    print(f"matrix: {family} {cell} worst update error {errors[worst]:.1e} ({worst})")  # the table in docs/models.md
    assert errors[worst] <= MAX_UPDATE_ERROR, (family, worst, errors[worst])
    for r in results:
        drift = {n: v for n, v in r["tp_spread"].items() if v > 0}
        assert not drift, f"TP peers differ in replicated parameters: {drift}"


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("family", H.FAMILIES)
def test_family_matches_one_process(pool, family, preset):
    strategy = dict(PRESETS[preset])
    if strategy["tp"] > 1 and family in REFUSED_UNDER_TP:
        # The plan is built (and refused) before any collective: check it in this process.
        with pytest.raises(ValueError, match="cannot place these projections") as refusal:
            infer_tp_plan(H.build(family))
        assert REFUSED_UNDER_TP[family] in str(refusal.value)
        strategy["tp_plan"] = H.suggested_plan(str(refusal.value))
    results = pool.run(H.fit, family, strategy, STEPS)
    _check_matches_one_process(family, results, cell=preset)
    # A tied embedding / LM head is one parameter on every rank, as in one process.
    assert results[0]["tied"] == H._tied_names(H.build(family))


TP_PP = dict(dp_shard=1, pp=2, tp=2, pp_schedule="1f1b")
"""pp=2 × tp=2. The per-rank batch of 2 runs as 2 micro-batches of 1 sequence, each with as many tokens:
the mean of their token-mean losses is the batch's, so the schedule's gradient is one process's."""
UNTIED = {"tie_word_embeddings": False}
"""The fix the pp refusal of a tie names (the embedding and the head live on different stages)."""
PP_RUNS = ("llama", "qwen2", "qwen3", "gemma", "mistral", "phi3", "olmo2", "cohere", "gemma2")
"""Families trained under tp_pp. llama_tied's fix (untie) is the llama cell; gpt2 has no layout pp can split.
Cohere (logit scale) and Gemma2 (final soft-cap, sliding/full layers) check the head-side work each stage keeps by
running the family's own forward."""


@pytest.mark.parametrize("family", [*PP_RUNS, "llama_tied", "gpt2"])
def test_family_tp_pp_matches_one_process(pool, family):
    from meshkit.plugins.pipeline import find_layer_stack

    strategy, overrides = dict(TP_PP), None
    if family == "gpt2":  # refused before any collective, tied or not: its blocks are `transformer.h`
        for o in (None, UNTIED):
            with pytest.raises(ValueError, match=r"cannot split `model` \(GPT2LMHeadModel\).*model.embed_tokens"):
                find_layer_stack(H.build(family, overrides=o).model)
        return
    if H._tied_names(H.build(family)):
        with pytest.raises(ValueError, match=r"ties lm_head.weight.*tie_word_embeddings=False"):
            find_layer_stack(H.build(family).model)
        overrides = UNTIED  # the fix the refusal names; the reference is the same untied model
    if family not in PP_RUNS:
        return
    if family in REFUSED_UNDER_TP:
        with pytest.raises(ValueError, match="cannot place these projections") as refusal:
            infer_tp_plan(H.build(family))
        strategy["tp_plan"] = H.suggested_plan(str(refusal.value))
    results = pool.run(H.fit, family, strategy, STEPS, overrides=overrides)
    assert len({frozenset(r["params"]) for r in results}) == 2, "two pipeline stages, each on a tp pair"
    _check_matches_one_process(family, results, overrides=overrides, cell="tp_pp")


CP_CELLS = [
    ("llama", "hf_labels"),
    ("qwen2", "hf_labels"),  # tied, q/k/v biases
    ("qwen3", "ce"),  # per-head q/k norms; CE by hand on the dict's input_ids / labels
    ("gemma", "hf_ids"),  # tied, scaled embedding; the DataLoader's dicts hold only input_ids
    ("mistral", "hf_labels"),  # sliding_window (4096) passed to attention, wider than the sequence
    ("olmo2", "hf_ids"),  # full-width q/k norms (float64)
]
"""cp=2 × dp_shard=2 cells: (family, loss form of hf_models.CausalLM)."""


@pytest.mark.parametrize("family,loss_form", CP_CELLS, ids=[f"{f}-{form}" for f, form in CP_CELLS])
def test_cp_matches_one_process(pool, family, loss_form):
    # `labels=batch["input_ids"]` on the cp dict batch: meshkit passes the labels shifted over the whole sequence
    # (HF must not shift the shard) and the cp group's mean target count (the ranks hold 7 and 8 per row for
    # `{"input_ids"}` dicts of 16 tokens, since the last one has no target).
    results = pool.run(H.fit, family, dict(dp_shard=2, cp=2, tp=1), STEPS, loss_form)
    _check_matches_one_process(family, results, loss_form, cell=f"cp {loss_form}")


def _cp_refusal(rank: int, world: int, family: str, overrides: dict) -> str:
    """``family`` under cp=2 as NDParallelStrategy runs it (apply, cut a batch of 16-token rows, check it, one
    forward): ``"<where>: <message>"`` of the refusal every rank raises, where is "apply", "batch" or "forward"."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshkit.plugins.context_parallel import apply_context_parallel, check_cp_batch, cp_position_ids, shard_batch

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = H.build(family, overrides=overrides).model
    where = "apply"
    try:
        apply_context_parallel(model, mesh["cp"])
        where = "batch"
        batch = shard_batch(T.tokens(2), mesh["cp"], position_ids=cp_position_ids(model))
        check_cp_batch(model, batch, 2)
        where = "forward"
        model(input_ids=batch["input_ids"])
    except ValueError as e:
        return f"{where}: {e}"
    return "no error"


SLIDING_QWEN2 = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                 "layer_types": ["full_attention", "sliding_attention"]}
CP_REFUSALS = [
    ("mistral", {"sliding_window": 8}, r"MistralAttention attends within `sliding_window=8` tokens, but the sequences "
                                       r"are 16 long.*`config.sliding_window=None`"),
    # per-layer windows: `sliding_window=None` raises in one process on the installed transformers; the fix is this
    ("qwen2", SLIDING_QWEN2, r'Qwen2Attention attends within `sliding_window=8`.*`config.layer_types = \["full_attention"\] \* 2`'),
    ("gemma2", {}, r"Gemma2Attention passes `softcap=50.0` to its attention, which context-parallel attention does not "
                   r"implement.*`config.attn_logit_softcapping=None`"),
]
"""(family, overrides, the refusal every rank raises under cp); qwen2's and gemma2's fixes are trained under cp."""


@pytest.mark.parametrize("family,overrides,match", CP_REFUSALS, ids=[c[0] for c in CP_REFUSALS])
def test_cp_refuses_what_it_does_not_implement_and_the_fix_trains(pool, family, overrides, match):
    messages = pool.run(_cp_refusal, family, overrides)
    for message in messages:  # before any collective: at apply (the proof) or when the batch is cut
        assert re.search(match, message) and message.startswith(("apply: ", "batch: ")), message
    if family == "mistral":  # its fix (no window) is the mistral cp cell of CP_CELLS
        return
    fixed = {**overrides, **H.suggested_config(messages[0].split(": ", 1)[1])}
    results = pool.run(H.fit, family, dict(dp_shard=2, cp=2, tp=1), STEPS, "ce", fixed)
    _check_matches_one_process(family, results, "ce", overrides=fixed, cell="cp fix")


def test_cp_batch_used_as_a_tensor_explains_itself():
    from meshkit.plugins.context_parallel import CPBatch

    batch = CPBatch({"input_ids": torch.zeros(2, 8), "labels": torch.zeros(2, 8)})
    with pytest.raises(TypeError, match=r"under context parallelism it is a dict.*'input_ids': \(2, 8\)"):
        batch[:, :-1]
    with pytest.raises(AttributeError, match=r"asked for `.shape`.*shift_labels=batch\['labels'\]"):
        batch.shape
    assert batch["input_ids"].shape == (2, 8)


def _lightning_aliases(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    from meshkit.plugins.dims import ParallelDims

    dims = ParallelDims(dp_shard=2, tp=2, world_size=world)
    mesh = dims.build_mesh("cpu")
    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    return (
        dist.get_process_group_ranks(tp.get_group()) == dist.get_process_group_ranks(mesh["tp"].get_group()),
        dist.get_process_group_ranks(dp.get_group()) == dist.get_process_group_ranks(dims.submesh("dp").get_group()),
    )


def test_lightning_mesh_aliases(pool):
    # configure_model code written for Lightning's ModelParallelStrategy reads these names.
    assert all(all(r) for r in pool.run(_lightning_aliases))


def test_pp_warns_when_training_step_loss_is_dropped():
    import warnings

    import lightning as L

    from meshkit.models.llama import LlamaConfig, LlamaLM
    from meshkit.plugins.pipeline.lightning import _warn_user_loss_dropped

    class Smoothed(L.LightningModule):
        def training_step(self, batch, batch_idx):
            return batch.float().mean()

    class WithPipelineLoss(Smoothed):
        def pipeline_loss(self, output, labels):
            return output.mean()

    with pytest.warns(UserWarning, match=r"`Smoothed.training_step` is not called under pipeline.*pipeline_loss"):
        _warn_user_loss_dropped(Smoothed())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_user_loss_dropped(WithPipelineLoss())
        _warn_user_loss_dropped(LlamaLM(LlamaConfig.tiny()))  # meshkit's own module computes the default loss


@pytest.mark.parametrize("family,overrides", [
    ("mistral", {"sliding_window": 4}),  # every layer sliding
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
               "layer_types": ["full_attention", "sliding_attention"]}),  # one of each
])
def test_pp_stage_forward_builds_each_layers_mask(family, overrides):
    # One process: a single stage holding every block runs the stage forward; it must equal the model's forward.
    from meshkit.plugins.pipeline import find_layer_stack
    from meshkit.plugins.pipeline.split import build_stage_module

    model = H.build(family, overrides={**UNTIED, **overrides}).model.eval()
    ids = T.tokens(2)[:, : T.SEQ]
    stage = build_stage_module(model, find_layer_stack(model), 0, 1, [])
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, stage(ids)
        full = H.build(family, overrides=UNTIED).model.eval()(input_ids=ids).logits  # same seed, no window
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (full - want).abs().max() > 1e-2  # the window matters at 16 tokens: a causal mask would differ


def test_cp_dict_without_labels_explains_the_missing_key():
    from meshkit.plugins.context_parallel import CPBatch

    with pytest.raises(KeyError, match=r"no 'labels'.*\['input_ids'\].*labels=batch\['input_ids'\]"):
        CPBatch({"input_ids": torch.zeros(2, 8), "positions": torch.zeros(2, 8)})["labels"]


def _view_warnings(rank: int, world: int, quiet: bool) -> list[str]:
    """A 2-step hsdp_tp fit of meshkit's own Llama (the demo's root: FSDPTransformer): FSDP2's view warnings."""
    import warnings

    import meshkit
    from meshkit.plugins import parallelize as P

    original = P.quiet_local_logits_warning
    if not quiet:  # the control: without meshkit's filter, FSDP2 does warn
        P.quiet_local_logits_warning = lambda *a: []
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")  # each warning once per place: enough, and cheap
            T.fit(rank, world, meshkit.NDParallelStrategy(dp_shard=2, tp=2), devices=world, steps=2)
    finally:
        P.quiet_local_logits_warning = original
    return [str(w.message) for w in seen if "returned a view tensor" in str(w.message)]


def test_tp_logits_view_warning_is_silenced_exactly(pool):
    # The LM head's to_local() logits are a view FSDP2 warns about on every rank; in-place ops on it raise instead.
    assert all(any("(FSDPTransformer) returned a view tensor" in m for m in r) for r in pool.run(_view_warnings, False))
    assert pool.run(_view_warnings, True) == [[]] * 4


def _tied_trainer(rank: int, world: int, **kwargs):
    import lightning as L

    import meshkit

    T.launcher_env(rank, world)
    return L.Trainer(
        accelerator="cpu", devices=world, strategy=meshkit.NDParallelStrategy(dp_shard=2, tp=2), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, max_steps=2, **kwargs,
    )


def _save_tied(rank: int, world: int, path: str) -> dict:
    """2 hsdp_tp steps of tied Qwen2, saved as a DCP folder; the full parameters."""
    from torch.utils.data import DataLoader

    module = H.build("qwen2")
    trainer = _tied_trainer(rank, world)
    trainer.fit(module, DataLoader(T.tokens(2 * T.PER_RANK_BATCH * world), batch_size=T.PER_RANK_BATCH))
    trainer.save_checkpoint(path)
    return T.full_params(module)


def _load_tied(rank: int, world: int, path: str, overrides: dict | None) -> dict:
    """Qwen2 (tied, or untied by ``overrides``) from another seed, restored from ``path`` (max_steps reached)."""
    from torch.utils.data import DataLoader

    module = H.build("qwen2", seed=1, overrides=overrides)
    _tied_trainer(rank, world).fit(module, DataLoader(T.tokens(16), batch_size=T.PER_RANK_BATCH), ckpt_path=path)
    return {"params": T.full_params(module), "tied": H._tied_names(module)}


def test_tied_checkpoint_has_one_fqn_and_loads_tied_or_untied(pool, tmp_path_factory):
    from torch.distributed.checkpoint import FileSystemReader

    path = str(tmp_path_factory.mktemp("tied") / "tied.ckpt")
    saved = pool.run(_save_tied, path)[0]
    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    emb, head = "state_dict.model.model.embed_tokens.weight", "state_dict.model.lm_head.weight"
    assert emb in keys and head not in keys  # one FQN for the tied weight, as transformers saves it
    tied = pool.run(_load_tied, path, None)[0]
    assert tied["tied"] == [("model.model.embed_tokens.weight", "model.lm_head.weight")]
    T.assert_params_close(tied["params"], saved, rtol=0)
    untied = pool.run(_load_tied, path, UNTIED)[0]
    assert untied["tied"] == []  # the head is its own parameter, loaded with the saved embedding
    want = {**saved, "model.lm_head.weight": saved["model.model.embed_tokens.weight"]}
    T.assert_params_close(untied["params"], want, rtol=0)


def _threads() -> tuple[int, int]:
    import os
    import threading

    return threading.active_count(), len(os.listdir("/proc/self/task"))  # Python threads; all (gloo's are C++)


def _fits_in_one_process(rank: int, world: int) -> dict:
    """Two hsdp_tp fits of new models, then the first Trainer fits again: threads after each, params after all."""
    import lightning as L
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, world)
    runs, threads = [], []
    for seed in range(2):
        module = T.build_module(seed=seed)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=meshkit.NDParallelStrategy(dp_shard=2, tp=2), logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, max_steps=1,
        )
        trainer.fit(module, DataLoader(T.tokens(T.PER_RANK_BATCH * world), batch_size=T.PER_RANK_BATCH))
        runs.append((trainer, module))
        threads.append(_threads())
    trainer, module = runs[0]
    trainer.fit_loop.epoch_loop.max_steps = 2  # fit again on the same Trainer: one more step on the same mesh
    trainer.fit(module, DataLoader(T.tokens(T.PER_RANK_BATCH * world), batch_size=T.PER_RANK_BATCH))
    threads.append(_threads())
    meshes = {id(t.strategy.parallel_dims.mesh) for t, _ in runs}
    return {"threads": threads, "steps": trainer.global_step, "meshes": len(meshes),
            "first_params": len(T.full_params(module))}  # the first model's groups still work after later fits


def test_fits_in_one_process_keep_the_thread_count(pool):
    # Each gloo group holds ~3 threads; each fit used to build a new mesh (10 groups) that nothing freed: the
    # pool's workers reached ~1,000 threads. A layout's mesh is now built once per process and reused.
    for r in pool.run(_fits_in_one_process):
        assert r["threads"][1:] == [r["threads"][0]] * 2, r["threads"]
        assert r["steps"] == 2 and r["meshes"] == 1 and r["first_params"] > 0


def _file_trainer(rank: int, world: int):
    import lightning as L

    import meshkit

    T.launcher_env(rank, world)
    strategy = meshkit.NDParallelStrategy(dp_shard=2, tp=2, save_distributed_checkpoint=False)
    return L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_steps=1,
    )


def _single_file_tied(rank: int, world: int, path: str) -> dict:
    """1 hsdp_tp step of tied Qwen2 saved as one file; loaded back into it (zeroed) and into an untied Qwen2."""
    from torch.utils.data import DataLoader

    from meshkit.plugins.checkpoint import TIED_WEIGHTS

    data = DataLoader(T.tokens(T.PER_RANK_BATCH * world), batch_size=T.PER_RANK_BATCH)
    module = H.build("qwen2")
    trainer = _file_trainer(rank, world)
    trainer.fit(module, data)
    trainer.save_checkpoint(path)
    saved = T.full_params(module)
    file = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    trainer.strategy.load_checkpoint(path)
    tied = T.full_params(module)
    untied = H.build("qwen2", seed=1, overrides=UNTIED)
    _file_trainer(rank, world).fit(untied, data, ckpt_path=path)
    return {"keys": set(file["state_dict"]), "aliases": file[TIED_WEIGHTS], "saved": saved, "tied": tied,
            "untied": T.full_params(untied), "untied_names": H._tied_names(untied)}


def test_single_file_checkpoint_stores_a_tied_weight_once_and_loads_tied_or_untied(pool, tmp_path_factory):
    r = pool.run(_single_file_tied, str(tmp_path_factory.mktemp("tied_file") / "tied.ckpt"))[0]
    emb, head = "model.model.embed_tokens.weight", "model.lm_head.weight"
    assert emb in r["keys"] and head not in r["keys"]  # one name, as the DCP folder stores it
    assert r["aliases"] == {head: emb}
    T.assert_params_close(r["tied"], r["saved"], rtol=0)
    assert r["untied_names"] == []
    T.assert_params_close(r["untied"], {**r["saved"], head: r["saved"][emb]}, rtol=0)
