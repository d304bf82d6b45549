"""Small random-init transformers models as real checkpoints have them, trained on a gloo pool and in one process.

The families of ``test_model_matrix.py``: ties, per-head norms, biases, GQA and fused projections
as the published configs set them, at tiny widths (never downloaded). :func:`fit` trains a plain
LightningModule under a meshkit strategy; :func:`reference` trains the same module, seed and data
in one process; :func:`update_errors` compares their final parameters.

Example::

    >>> results = pool.run(fit, "qwen3", dict(dp_shard=2, tp=2), 6)  # doctest: +SKIP
    >>> losses, init, final = reference("qwen3", 6, dp=2)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import training as T

LR = 2.0
"""Large on purpose: after a few steps a wrong gradient moves parameters visibly."""
DTYPE = torch.float64
"""Every family trains in float64: the matrix measures the layout, not the rounding. In float32 the rounding of a
few steps at lr 2 is itself of the order of the limit: OLMo2's full-width q/k norms gave 1.3e-2 in ONE process from
splitting each step's batch into 4 micro-batches alone, and qwen3's q_norm under tp_pp failed 3.2e-3 > 1e-3 on a
clean venv (5.4e-4 on another run) -- a flaky limit, not a layout bug."""


_COMMON = dict(
    vocab_size=T.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None,
    bos_token_id=None, eos_token_id=None,  # the published ids lie outside the tiny vocabulary
)


def _config(family: str, overrides: dict | None = None) -> Any:
    """The family's tiny config; ``overrides`` sets config attributes (e.g. the fix a refusal names)."""
    import transformers as tf

    configs: dict[str, Callable[[], Any]] = {
        "llama": lambda: tf.LlamaConfig(**_COMMON, tie_word_embeddings=False),
        "llama_tied": lambda: tf.LlamaConfig(**_COMMON, tie_word_embeddings=True),  # Llama-3.2-1B/3B
        "qwen2": lambda: tf.Qwen2Config(**_COMMON, tie_word_embeddings=True),  # q/k/v biases, tied (0.5-3B)
        "qwen3": lambda: tf.Qwen3Config(**_COMMON, head_dim=8, tie_word_embeddings=False),  # per-head q/k norms
        "gemma": lambda: tf.GemmaConfig(**_COMMON, head_dim=8),  # tied by default
        # Not in FAMILIES: pipeline cells of head-side work the stages must keep (tied by default, so tp_pp unties).
        "cohere": lambda: tf.CohereConfig(**_COMMON, logit_scale=0.25),  # logits * logit_scale after lm_head
        "gemma2": lambda: tf.Gemma2Config(**_COMMON, head_dim=8, final_logit_softcapping=1.0),  # final soft-cap
        "mistral": lambda: tf.MistralConfig(**_COMMON),
        "gpt2": lambda: tf.GPT2Config(vocab_size=T.VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=None, eos_token_id=None),
        "phi3": lambda: tf.Phi3Config(**_COMMON),  # fused qkv_proj, gate_up_proj
        "olmo2": lambda: tf.Olmo2Config(**_COMMON),  # full-width q_norm / k_norm
        # Not in the matrix (FAMILIES): the TP checks' cases. StableLM views q with the config's global head count,
        # and with qk_layernorm holds one LayerNorm per head in a ModuleList (test_tp_checks.py, test_tp_sp.py).
        "stablelm": lambda: tf.StableLmConfig(**_COMMON, qk_layernorm=True),
        "stablelm_noqk": lambda: tf.StableLmConfig(**_COMMON, qk_layernorm=False),
    }
    if family.startswith(AUTO):  # benchmarks/family_sweep.py: any registered causal LM, its tiny twin config
        from meshkit.families import tiny_config

        config = tiny_config(tf.AutoConfig.for_model(family[len(AUTO):]))
        config.vocab_size = T.VOCAB
        config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    else:
        config = configs[family]()
    # sdpa where the class has it, else (Gemma2's soft-cap, sinks, ...) transformers' own eager math; both run in
    # float64 under Float64Math.
    sdpa = getattr(tf.AutoModelForCausalLM._model_mapping[type(config)], "_supports_sdpa", False)
    config._attn_implementation = "sdpa" if sdpa else "eager"
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return config


AUTO = "auto:"
"""``"auto:<model_type>"``: the tiny config of any causal LM transformers registers (meshkit.families.tiny_config,
eager attention, the test vocabulary), as the family sweep builds it."""

class Float64Math(TorchDispatchMode):
    """Inside it, every float32 a family's code asks for is float64: ``x.float()``, ``.to(torch.float32)``,
    ``softmax(..., dtype=torch.float32)``, ``torch.arange(..., dtype=torch.float)``.

    Many families compute part of their math in float32 on purpose (RMSNorm's ``x.float()`` in Gemma 1-3, eager
    attention's float32 softmax, rotary tables, MoE routers). Inside a float64 model that rounds each such step to
    float32, and a float64 difference of 1e-16 between two equal computations (a sum in another order: the dp
    ranks' gradient reduction, cp's ring attention) flips a float32 rounding now and then, so the comparison
    measured float32 rounding amplified by lr 2 (gemma3_text: 1e-6 under fsdp2, 3e-5 under cp), not the layout.
    With this mode on, in one process and on every rank alike, the family's own code runs as written, in float64:
    nothing of its math is re-implemented. ``casts`` counts what it changed (the family's float32 steps).

    A dispatch mode (aten ops, below autograd), not a function mode: the autograd engine keeps it, so backward and
    activation checkpointing's recomputation inside backward run the same float64 math as the forward (a
    ``TorchFunctionMode`` is popped while it handles ``Tensor.backward``, and the recomputation ran in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(a is torch.float32 for a in args) or any(v is torch.float32 for v in kwargs.values()):
            self.casts += 1
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def float64_math(dtype: torch.dtype = DTYPE) -> Any:
    """:class:`Float64Math` for a float64 run, else a no-op context (a float32 run keeps the family's casts)."""
    import contextlib

    return Float64Math() if dtype == torch.float64 else contextlib.nullcontext()


FAMILIES = ("llama", "llama_tied", "qwen2", "qwen3", "gemma", "mistral", "gpt2", "phi3", "olmo2")

DRAWN_IN_INIT = {"gpt2": "transformers' Conv1D draws its weight in `__init__` (no `reset_parameters()` replays it)"}
"""Families whose build draws random numbers outside any init meshkit can replay: the RNG streams part there, so
their random parameters are compared by distribution (every other family: bit for bit)."""


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build under ``dtype`` (a buffer computed in it is not rounded through float32 before a cast)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def own_init(family: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> CausalLM:
    """The family built for real under default dtype ``dtype`` from ``seed``: the truth an ``empty_init`` build
    (materialized from the same RNG state) is compared with by :func:`init_mismatches`."""
    with default_dtype(dtype):
        torch.manual_seed(seed)
        return CausalLM(family)


def empty_init(family: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> CausalLM:
    """The family built on the meta device (as under ``trainer.init_module(empty_init=True)``) and materialized in
    one process from ``seed``'s RNG state."""
    from meshkit.plugins.materialize import materialize

    with default_dtype(dtype):
        with torch.device("meta"):
            empty = CausalLM(family)
        torch.manual_seed(seed)  # the meta build drew nothing
        materialize(empty, torch.device("cpu"))
    return empty


def init_tensors(module: torch.nn.Module) -> tuple[dict, dict]:
    """``(buffers, parameters)`` by name, what :func:`init_mismatches` compares (every name of a shared buffer)."""
    return dict(module.named_buffers(remove_duplicate=False)), dict(module.named_parameters())


def init_mismatches(want: tuple[dict, dict], got: tuple[dict, dict], by_distribution: bool = False) -> list[str]:
    """What of an ``empty_init`` build's ``(buffers, parameters)`` differs from the build ``want``: every buffer bit
    for bit (rotary tables, embedding scales); every parameter bit for bit, or with ``by_distribution`` (a
    :data:`DRAWN_IN_INIT` family against its own init) constants (norms, biases) bit for bit and random ones by
    distribution (std and mean within 6 sigma of a sample's). One line per tensor that differs; none when equal."""
    out: list[str] = []
    for kind, w_all, g_all in (("buffer", want[0], got[0]), ("parameter", want[1], got[1])):
        if w_all.keys() != g_all.keys():
            out.append(f"{kind} names differ: {sorted(set(w_all) ^ set(g_all))}")
            continue
        for name, w in w_all.items():
            w, g = w.detach(), g_all[name].detach()
            if torch.equal(w, g):
                continue
            if w.shape != g.shape or w.dtype != g.dtype:
                out.append(f"{kind} {name}: {tuple(g.shape)} {g.dtype}, want {tuple(w.shape)} {w.dtype}")
                continue
            if kind == "parameter" and by_distribution and float(w.std()) != 0.0:
                n = w.numel()  # a sample std's relative error is ~1/sqrt(2n); a mean's is std/sqrt(n): 6 sigma
                if (abs(float(g.std()) / float(w.std()) - 1) < 6 / (2 * n) ** 0.5
                        and abs(float(g.mean()) - float(w.mean())) < 6 * float(w.std()) * (2 / n) ** 0.5):
                    continue
                out.append(f"{kind} {name}: std {float(g.std()):.4g} mean {float(g.mean()):.4g}, want std "
                           f"{float(w.std()):.4g} mean {float(w.mean()):.4g}")
                continue
            out.append(f"{kind} {name}: max |got - want| {float((g.double() - w.double()).abs().max()):.3g} "
                       f"(got {g.flatten()[:3].tolist()}, want {w.flatten()[:3].tolist()})")
    return out


def _lightning_base() -> type:
    import lightning as L

    return L.LightningModule


class CausalLM(_lightning_base()):  # type: ignore[misc]
    """A plain LightningModule around ``AutoModelForCausalLM`` with SGD.

    ``loss_form`` (see :data:`LOSS_FORMS`): ``"ce"``: CE by hand on ``batch[:, :-1]`` / ``batch[:, 1:]`` (under cp
    on the dict's ``input_ids`` / ``labels``). ``"hf_labels"``: the transformers idiom
    ``model(input_ids=ids, labels=ids).loss``, on the token tensor or (under cp) the dict's ``input_ids``.
    ``"hf_ids"``: the DataLoader yields ``{"input_ids": (B, T)}`` dicts and the loss is that idiom on them.
    """

    def __init__(self, family: str, lr: float = LR, loss_form: str = "ce", overrides: dict | None = None) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.lr, self.loss_form = lr, loss_form
        self.model = AutoModelForCausalLM.from_config(_config(family, overrides))

    def loss(self, batch: Any) -> torch.Tensor:
        if self.loss_form in ("hf_labels", "hf_ids"):
            ids = batch["input_ids"] if isinstance(batch, dict) else batch
            return self.model(input_ids=ids, labels=ids).loss
        ids, labels = (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) else (batch[:, :-1], batch[:, 1:])
        logits = self.model(input_ids=ids).logits
        logits = logits if logits.dtype == torch.float64 else logits.float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


LOSS_FORMS = ("ce", "hf_labels", "hf_ids")


class IdsDicts(torch.utils.data.Dataset):
    """``{"input_ids": row[:SEQ]}`` per token row: what an HF collator without labels yields."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i, : T.SEQ]}


def dataset(rows: torch.Tensor, loss_form: str) -> Any:
    """The rows as the DataLoader of ``loss_form`` sees them (token rows, or ids-only dicts)."""
    return IdsDicts(rows) if loss_form == "hf_ids" else rows


def build(
    family: str, seed: int = 0, loss_form: str = "ce", overrides: dict | None = None, dtype: torch.dtype = DTYPE
) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(family, loss_form=loss_form, overrides=overrides).to(dtype)


def reference(
    family: str, steps: int, dp: int, world: int = 4, loss_form: str = "ce", overrides: dict | None = None,
    dtype: torch.dtype = DTYPE, fused_kernels: bool = False, micro: int = 1,
) -> tuple[list[float], dict, dict]:
    """One process, each step's global batch: (losses, initial parameters, final parameters). ``fused_kernels``
    patches the model as the strategy's option does (meshkit.integrations.apply_fused_kernels). ``micro`` > 1
    accumulates each step's batch in that many equal parts: the same step summed in another order, whose distance
    to ``micro=1`` is the family's own rounding floor (:func:`noise_floor`)."""
    module = build(family, loss_form=loss_form, overrides=overrides, dtype=dtype)
    if fused_kernels:
        from meshkit.integrations import apply_fused_kernels

        apply_fused_kernels(module.model)
    init = {n: p.detach().clone() for n, p in module.named_parameters()}
    opt = module.configure_optimizers()
    data = T.tokens(steps * T.PER_RANK_BATCH * world)
    losses = []
    with float64_math(dtype):
        for idx in T.step_batches(len(data), dp, steps):
            opt.zero_grad()
            loss = 0.0
            for part in torch.tensor_split(idx, micro):
                part_loss = module.loss({"input_ids": data[part, : T.SEQ]} if loss_form == "hf_ids" else data[part])
                (part_loss * (len(part) / len(idx))).backward()
                loss = loss + part_loss.detach() * (len(part) / len(idx))
            opt.step()
            losses.append(float(loss))
    return losses, init, {n: p.detach().clone() for n, p in module.named_parameters()}


def noise_floor(family: str, steps: int, dp: int, overrides: dict | None = None) -> float:
    """The worst update error between two one-process runs of the same steps, one summing each step's batch in
    two halves: how far the family's own float64 rounding, amplified by lr 2, moves its parameters with no
    layout at all (llama 6e-15; post-LayerNorm families such as BERT 3e-9 and BioGPT 5e-8). A distributed cell
    near it is exact; far above it (1e-2 for a wrong gradient), it is not."""
    _, init, want = reference(family, steps, dp, overrides=overrides)
    _, _, split = reference(family, steps, dp, overrides=overrides, micro=2)
    return max(update_errors(split, init, want).values())


def _tp_replica_spread(module: torch.nn.Module, tp_mesh: Any) -> dict[str, float]:
    """Per parameter replicated over tp: max |local - peer's local| over the tp group (0 when in sync)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    if tp_mesh.size() == 1:
        return {}
    out: dict[str, float] = {}
    for name, p in module.named_parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            if not isinstance(p.placements[p.device_mesh.mesh_dim_names.index("tp")], Replicate):
                continue
        local = (p.to_local() if isinstance(p, DTensor) else p).detach().contiguous()
        peers = [torch.empty_like(local) for _ in range(tp_mesh.size())]
        dist.all_gather(peers, local, group=tp_mesh.get_group())
        out[name] = max(float((q - local).abs().max()) for q in peers) if local.numel() else 0.0
    return out


def fit(
    rank: int, world: int, family: str, strategy: dict, steps: int, loss_form: str = "ce", overrides: dict | None = None,
    callbacks: list | None = None, dtype: torch.dtype = DTYPE,
) -> dict[str, Any]:
    """Fit ``steps`` steps under ``NDParallelStrategy(**strategy)``: losses, full parameters, tp spread.
    ``callbacks`` are added to the Trainer's (the caller reads what they record).

    Under pp each rank returns the parameters of its own stages (merge them with :func:`merged_params`)."""
    import lightning as L
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, world)
    module = build(family, loss_form=loss_form, overrides=overrides, dtype=dtype)
    recorder = T.LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=meshkit.NDParallelStrategy(**strategy), max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder, *(callbacks or [])],
    )
    rows = T.tokens(steps * T.PER_RANK_BATCH * world)
    with float64_math(dtype):  # as reference() runs the family: its float32 steps in float64
        trainer.fit(module, DataLoader(dataset(rows, loss_form), batch_size=T.PER_RANK_BATCH))
    dims = trainer.strategy.parallel_dims
    dp = dims.submesh("dp")
    return {
        "losses": recorder.losses,
        "dp_rank": dp.get_local_rank(),
        "dp_size": dp.size(),
        "params": T.full_params(module),
        "tp_spread": _tp_replica_spread(module, dims.mesh["tp"]),
        "tied": _tied_names(module),
    }


def _tied_names(module: torch.nn.Module) -> list[tuple[str, ...]]:
    """Groups of parameter names that are one Parameter object."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(tuple(g) for g in groups.values() if len(g) > 1)


def suggested_plan(error: str) -> dict[str, str]:
    """The ``tp_plan={...}`` a refusal suggests, parsed from its message (the test applies it)."""
    import ast
    import re

    found = re.search(r"tp_plan=(\{[^}]*\})\)", error)
    assert found, error
    return ast.literal_eval(found.group(1))


def suggested_config(error: str) -> dict[str, Any]:
    """The config change a refusal names (```config.KEY=VALUE``` or ```config.KEY = [...] * N```), as overrides."""
    import ast
    import re

    found = re.search(r"`config\.(\w+) ?= ?([^`]+)`", error)
    assert found, error
    key, value = found.group(1), found.group(2).strip()
    repeated = re.fullmatch(r"(\[.*\]) \* (\d+)", value)
    return {key: ast.literal_eval(repeated.group(1)) * int(repeated.group(2)) if repeated else ast.literal_eval(value)}


def merged_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's parameters in one dict (pp ranks hold different stages; others hold them all)."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r["params"])
    return out


NO_UPDATE = 1e-9
"""A parameter whose one-process update max|ref - init| is below this has no update to measure (it gets no
gradient: an attention key bias, which softmax ignores, moved by 2e-18 in RemBERT); its error is taken against
this instead, i.e. it must agree to 1e-15 absolute at the 1e-6 limit. Trained parameters move by 1e-4..1e-1."""


def update_errors(got: dict, init: dict, want: dict) -> dict[str, float]:
    """max|dist - ref| / max(max|ref - init|, :data:`NO_UPDATE`) for every parameter (names must match)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return {
        n: float((got[n] - want[n]).abs().max() / (want[n] - init[n]).abs().max().clamp_min(NO_UPDATE))
        for n in want
    }


def family_sweep() -> Any:
    """benchmarks/family_sweep.py as a module (it is a script, not a package), for the tests that run its parts."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "family_sweep.py"
    spec = importlib.util.spec_from_file_location("family_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
