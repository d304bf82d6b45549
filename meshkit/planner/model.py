"""The model side of the planner: the shape (:class:`ModelSpec`), its parameter and FLOP counts, and the
memory its states and activations take per GPU.

Units: bytes, FLOP; "GB" in the output is GiB (2**30 bytes, as torch.cuda reports memory).

Example::

    >>> from meshkit.planner import ModelSpec, model_state_bytes
    >>> spec = ModelSpec(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000)
    >>> round(model_state_bytes(spec.total_params, 3, 8) / 2**30, 1)   # ZeRO-3 over 8 GPUs
    12.6
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from meshkit.modelspec import read_shape

__all__ = [
    "GiB",
    "CHECKPOINTING",
    "AC_KINDS",
    "ModelSpec",
    "FFN_MULTIPLE",
    "round_ffn",
    "model_state_bytes",
    "zero3_buffer_bytes",
    "zero_buffer_bytes",
    "PIPELINE_SPLITS",
    "stage_layers",
    "activation_bytes_per_layer",
]

GiB = float(2**30)
CHECKPOINTING: tuple[str, ...] = ("none", "selective", "full")
"""The activation checkpointing meshkit's runtime runs (:data:`meshkit.plugins.activation_checkpoint.AC_MODES`, the
same meaning: "selective" keeps every matmul and attention output and recomputes only the elementwise / norm ops;
without FlashAttention the planner costs it as Korthikanti et al.'s selective recomputation, the scores dropped)."""
AC_KINDS: tuple[str, ...] = CHECKPOINTING + ("torchtitan_op",)
"""What a published run's layout may state (``ac=``): the runtime's kinds plus torchtitan's op-level selective AC
("torchtitan_op": saves every second matmul and attention, recomputes wk, wo, w3 and the elementwise ops), which
meshkit does not run and the search does not propose."""
PIPELINE_SPLITS: tuple[str, ...] = ("even", "balanced")
"""How a pipeline spreads the layers over its stages (:func:`stage_layers`): "even" splits the L blocks alone;
"balanced" counts the embedding and the output layer as one block each (L + 2 slots), so the first and the last
stage hold one block fewer (Llama 3, arXiv 2407.21783 §3.3.2; torchtitan's ``input_weight``/``output_weight``)."""
FFN_MULTIPLE = 256
"""SwiGLU widths are built as multiples of this (Llama's ``multiple_of=256``: 14336, 28672, 53248)."""


def round_ffn(width: float, heads: int) -> int:
    """A derived SwiGLU width rounded up the way real models are built: to a multiple of 256 (Llama's
    ``FeedForward(multiple_of=256)``), or of lcm(256, heads) when heads does not divide that, so every tensor
    parallel degree that divides the heads also divides the width (a derived width never forbids a tp).

    >>> round_ffn(24413.6, 64), round_ffn(53619.2, 128), round_ffn(1000, 24)   # 70B, 405B from params; 24 heads
    (24576, 53760, 1536)
    """
    multiple = FFN_MULTIPLE if FFN_MULTIPLE % heads == 0 else math.lcm(FFN_MULTIPLE, heads)
    return multiple * max(1, math.ceil(width / multiple - 1e-9))


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-style decoder the planner needs (build one from a config with :meth:`from_config`).

    Example::

        >>> ModelSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256).total_params / 1e9
        70.553706496
    """

    layers: int
    """Transformer blocks."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention (query) heads a."""
    kv_heads: int | None = None
    """Key/value heads (GQA); None means ``heads``."""
    ffn: int | None = None
    """SwiGLU hidden size; None: derived from ``params`` if given (rounded up as real models are built, see
    :data:`FFN_MULTIPLE`), else 4·h (GPT's MLP; 12·h² per layer)."""
    vocab: int = 32000
    """Vocabulary size."""
    params: float | None = None
    """Total parameters; when given, every count derived from the shape is scaled to it."""
    tied_embeddings: bool = False
    """Input embedding and output projection share one matrix."""
    dropout: bool = False
    """Dropout after attention and after the MLP, each keeping a 1-byte mask per activation (GPT's and Megatron-LM's
    default ``hidden_dropout=0.1``). Llama-style decoders have no dropout layer (Meta's reference ``llama/model.py``),
    so their activations lack Korthikanti's 2·s·b·h of masks (:func:`activation_bytes_per_layer`)."""
    head_dim: int | None = field(default=None, kw_only=True)
    """Size of one head; None means ``hidden // heads`` (Qwen3 and Gemma set it apart)."""
    gated_mlp: bool = field(default=True, kw_only=True)
    """Three MLP matrices (SwiGLU: w1, w3, w2); False: two (GPT's fc and proj, of width ``ffn``)."""
    parallel_blocks: bool = field(default=False, kw_only=True)
    """Attention and MLP read the same normed input and add to the residual together, x + attn(n(x)) + mlp(n(x))
    (GPT-J, GPT-NeoX's ``use_parallel_residual``, PaLM §2, Falcon): under tensor parallelism their two partial sums
    are reduced by one collective, so a block runs half the TP collectives of the serial x + attn, then + mlp
    (:func:`~meshkit.planner.costs.tp_bytes_per_layer`). The FLOPs and parameters are the same."""
    ffn_derived: bool = field(default=False, init=False, compare=False, repr=False)
    """True when ``ffn`` was derived from ``params`` (and rounded) rather than given."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab"):
            _check_positive_int(f"ModelSpec: `{name}", getattr(self, name))
        for name in ("kv_heads", "ffn"):
            if getattr(self, name) is not None:
                _check_positive_int(f"ModelSpec: `{name}", getattr(self, name))
        if self.head_dim is not None:
            _check_positive_int("ModelSpec: `head_dim", self.head_dim)
        elif self.hidden % self.heads:
            raise ValueError(
                f"ModelSpec: `hidden={self.hidden}` must be divisible by `heads={self.heads}` (whole heads). "
                "Pass the model's real head count."
            )
        kv = self.kv_heads or self.heads
        if self.heads % kv:
            raise ValueError(f"ModelSpec: `heads={self.heads}` must be divisible by `kv_heads={kv}` (GQA groups).")
        object.__setattr__(self, "kv_heads", kv)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.params is not None and not (self.params > 0):
            raise ValueError(f"ModelSpec: `params={self.params}` must be > 0 (a count of parameters, e.g. 7e9).")
        if self.ffn is None:
            ffn = 4 * self.hidden
            if self.params is not None:
                rest = self.params - self._embedding_params() - self.layers * self._attention_params()
                ffn = rest / (self.mlp_matrices * self.hidden * self.layers)
                if ffn < 1:
                    raise ValueError(
                        f"ModelSpec: `params={self.params:.3g}` is smaller than the embeddings and attention of "
                        f"`layers={self.layers}`, `hidden={self.hidden}`, `vocab={self.vocab}` alone, "
                        "so no FFN size fits. "
                        "Check the shape or pass `ffn=`."
                    )
                ffn = round_ffn(ffn, self.heads)
                object.__setattr__(self, "ffn_derived", True)
            object.__setattr__(self, "ffn", ffn)

    # ---- parameter counts (before the optional scaling to `params`) ----
    @property
    def mlp_matrices(self) -> int:
        """Matrices of h × ffn in the MLP: 3 gated (SwiGLU), 2 not (GPT)."""
        return 3 if self.gated_mlp else 2

    def _attention_params(self) -> int:
        # wq (h × a·hd) + wk, wv (h × kv·hd each) + wo (a·hd × h) + two RMSNorm weights
        hd = self.head_dim
        return 2 * self.hidden * self.heads * hd + 2 * self.hidden * self.kv_heads * hd + 2 * self.hidden

    def _embedding_params(self) -> int:
        # tok_embeddings + output (unless tied) + final norm
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def _scale(self) -> float:
        raw = self.layers * (self._attention_params() + self.mlp_matrices * self.hidden * self.ffn) + self._embedding_params()
        return 1.0 if self.params is None else self.params / raw

    @property
    def layer_params(self) -> float:
        """Parameters of one transformer block: attention, the MLP (w1, w2, w3, or GPT's two) and its two norms."""
        return (self._attention_params() + self.mlp_matrices * self.hidden * self.ffn) * self._scale

    @property
    def vocab_params(self) -> float:
        """Parameters of one vocabulary matrix (the embedding, or the output projection)."""
        return self.vocab * self.hidden * self._scale

    @property
    def total_params(self) -> float:
        return self.layers * self.layer_params + self._embedding_params() * self._scale

    @property
    def op_sac_recompute_params(self) -> float:
        """Parameters of the matmuls torchtitan's op-level selective checkpointing recomputes in backward: its policy
        saves the output of every odd-numbered matmul of a block (and of attention), so of wq, wk, wv, wo, w1, w3, w2
        it re-runs wk, wo and w3 (torchtitan ``activation_checkpoint.py``: "except every second mm")."""
        hd = self.head_dim
        per_layer = self.hidden * self.kv_heads * hd + self.heads * hd * self.hidden + self.hidden * self.ffn
        return self.layers * per_layer * self._scale

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token, forward + backward: the profiler's rule
        (:func:`meshkit.profiling.flops.model_flops_per_token`, 6·N + 12·L·H·Q·T with N the parameters but the input
        embedding, the final norm and the LM head once), on this shape.

        >>> ModelSpec(layers=2, hidden=64, heads=4, ffn=128, vocab=100).flops_per_token(16)
        556416.0
        """
        from meshkit.profiling.flops import ModelShape, model_flops_per_token  # plugins may import profiling

        n = self.layers * self.layer_params + (self.vocab * self.hidden + self.hidden) * self._scale
        return model_flops_per_token(ModelShape(n_params=round(n), n_layers=self.layers, n_heads=self.heads,
                                                head_dim=self.head_dim), seq_len)

    @property
    def matmul_params(self) -> float:
        """Parameters used in matmuls: all but the input embedding lookup (the output projection counts)."""
        return self.layers * self.layer_params + self.vocab_params

    @classmethod
    def from_config(cls, config: Any, params: float | None = None) -> "ModelSpec":
        """From anything :func:`meshkit.modelspec.read_shape` reads (a meshkit ``LlamaConfig``, a Hugging Face
        config, torchtitan-style args, a module with ``.config`` or containing one, e.g. a LightningModule
        around an HF model), or a ``ModelSpec`` (returned as is).

        Example::

            >>> from meshkit.models import LlamaConfig
            >>> ModelSpec.from_config(LlamaConfig.tiny()).kv_heads
            2
        """
        if isinstance(config, ModelSpec):
            return config
        try:
            shape = read_shape(config)
        except ValueError as exc:
            raise ValueError(
                f"ModelSpec.from_config: `config={type(config).__name__}` has neither meshkit LlamaConfig fields "
                "(n_layers, dim, n_heads) nor Hugging Face ones (num_hidden_layers, hidden_size, num_attention_heads). "
                "Pass a ModelSpec(layers=..., hidden=..., heads=...) instead."
            ) from exc
        return cls(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                   ffn=shape.ffn, vocab=shape.vocab, params=params, tied_embeddings=shape.tied_embeddings,
                   head_dim=shape.head_dim,
                   gated_mlp=shape.gated_mlp)


def _check_positive_int(name: str, value: Any) -> None:
    """``name`` is "Owner: `field" (the backquote is closed here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}` must be a positive int.")


def model_state_bytes(params: float, zero_stage: int, shard: int, optimizer_bytes: float = 16.0,
                      param_bytes: float = 2.0, grad_bytes: float = 2.0) -> float:
    """Bytes of parameters, gradients and optimizer state per GPU for ``params`` parameters on it.

    ZeRO (Rajbhandari et al. 2020, §5, Fig. 1): with K = optimizer_bytes − param_bytes − grad_bytes
    (AdamW mixed precision: 16 = 2 bf16 weights + 2 bf16 grads + 12 fp32 master, m, v) and N = ``shard``:
    stage 0 (DDP) (2+2+K)Ψ; stage 1 (2+2)Ψ + KΨ/N; stage 2 2Ψ + (2+K)Ψ/N; stage 3 (2+2+K)Ψ/N.

    >>> model_state_bytes(7.5e9, 1, 64) / 1e9   # the paper's Fig. 1 example: 31.4 GB
    31.40625
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"model_state_bytes: `zero_stage={zero_stage}` must be 0, 1, 2 or 3.")
    k = optimizer_bytes - param_bytes - grad_bytes
    if zero_stage == 0:
        return params * (param_bytes + grad_bytes + k)
    if zero_stage == 1:
        return params * (param_bytes + grad_bytes + k / shard)
    if zero_stage == 2:
        return params * (param_bytes + (grad_bytes + k) / shard)
    return params * (param_bytes + grad_bytes + k) / shard


def zero3_buffer_bytes(layer_params: float, param_bytes: float = 2.0, grad_bytes: float = 2.0) -> float:
    """Working memory ZeRO-3 / FSDP adds: two layers' gathered weights (current + prefetched) and one
    layer's unsharded gradient before its reduce-scatter (Rajbhandari et al. 2020 §5.3; FSDP2 prefetches
    one block ahead). ``layer_params`` is one block's parameters on this GPU (after TP)."""
    return layer_params * (2 * param_bytes + grad_bytes)


def zero_buffer_bytes(layer_params: float, zero_stage: int, param_bytes: float = 2.0, grad_bytes: float = 2.0) -> float:
    """Working memory a ZeRO stage adds beyond :func:`model_state_bytes`, for blocks of ``layer_params`` on this GPU.

    ZeRO-3: :func:`zero3_buffer_bytes`. ZeRO-2 (FSDP without resharding after forward, Llama 3's): each block's
    unsharded gradient exists from its backward until its reduce-scatter, one block at a time. ZeRO-0/1 keep the
    whole gradient, already in the model states: nothing more.

    >>> zero_buffer_bytes(1e6, 2), zero_buffer_bytes(1e6, 1)
    (2000000.0, 0.0)
    """
    if zero_stage == 3:
        return zero3_buffer_bytes(layer_params, param_bytes, grad_bytes)
    return layer_params * grad_bytes if zero_stage == 2 else 0.0


def stage_layers(layers: int, pp: int, split: str = "even") -> tuple[int, int]:
    """Transformer blocks on ``(an end stage, a middle stage)`` of a ``pp``-stage pipeline: at most that many.

    "even": ⌈L/p⌉ on every stage (the end stages also hold the embedding or the output layer). "balanced" (Llama 3,
    arXiv 2407.21783 §3.3.2: "we reduce one Transformer layer each from the first and the last stages"): the
    embedding and the output layer each take one block's slot, L + 2 slots, ⌈(L + 2)/p⌉ per stage, so an end stage
    holds one block fewer. Llama 3 405B on 16 stages: 128 slots, 7 blocks on the end stages, 8 in the middle.

    >>> stage_layers(126, 16), stage_layers(126, 16, "balanced"), stage_layers(80, 1, "balanced")
    ((8, 8), (7, 8), (80, 80))
    """
    if split not in PIPELINE_SPLITS:
        raise ValueError(f"stage_layers: `split={split!r}` must be one of {PIPELINE_SPLITS}.")
    if pp == 1:
        return layers, layers
    if split == "even":
        per = math.ceil(layers / pp)
        return per, per
    per = math.ceil((layers + 2) / pp)
    return per - 1, per


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, *,
                               sequence_parallel: bool = False, attention_scores: bool = True,
                               checkpointing: str = "none", ffn: int | None = None,
                               kv_heads: int | None = None, dropout: bool = True) -> float:
    """Activation bytes one transformer layer keeps for backward, for one micro-batch (16-bit activations).

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
    eq. (2)/(3) with tensor parallelism  s·b·h·(10 + 24/t + 5·a·s/(h·t));
    eq. (4) with sequence parallelism   s·b·h/t·(34 + 5·a·s/h);
    selective recomputation (§5) drops the 5·a·s/h attention-score term, as FlashAttention does
    (``attention_scores=False``: it never stores the s×s scores); full recomputation keeps only the
    layer input, 2·s·b·h (÷ t with sequence parallelism).
    The paper's 24/t is 8 (attention) + 16 (a 4h GELU MLP's two 4h outputs); a SwiGLU MLP of width
    ``ffn`` = f stores three f-wide outputs (w1, w3, their product), so with ``ffn`` given 24 becomes
    8 + 6·f/h (the same 24 at Llama's f = 8h/3; 27.5 at Llama-3-405B's f = 3.25h). The attention's 8 is Q, K
    (2 + 2), V (2) and the output projection's input (2); with grouped-query attention (``kv_heads`` = kv < a)
    K and V are kv/a as wide, so it is 4 + 4·kv/a (4.5 for Llama 3 70B's 8 of 64 heads, 4.25 for 405B's 8 of 128).
    The paper's 10 is the two norms' inputs (4), the inputs of the QKV and first MLP matmuls (2 + 2) and the two
    dropout masks (1 + 1 byte per element); a model without dropout (``dropout=False``, every Llama) keeps 8.

    With FlashAttention (``attention_scores=False``) ``checkpointing="selective"`` is meshkit's runtime's selective AC
    (:mod:`meshkit.plugins.activation_checkpoint`: every matmul and attention output kept, the elementwise ops
    recomputed): per layer 2·sbh·(3 + 2 + 2·kv/a + 2·f/h) without TP (the block input, wo's and w2's outputs; q and
    the attention output; k, v; w1's and w3's outputs); under TP the column-parallel outputs ÷ t and the other 3 ÷ t
    only with SP; a GELU MLP (``ffn`` None) keeps one 4h output. ``"torchtitan_op"`` is torchtitan's op-level selective AC: it keeps
    the block input and the outputs of attention and of every odd-numbered matmul (wq, wv, w1, w2) and recomputes
    the rest (wk, wo, w3, norms, SwiGLU, RoPE). Per layer: without TP 2·sbh·(4 + kv/a + f/h); with TP and SP
    the row-parallel w2's full-width partial sum 2·sbh plus 2·sbh·(5 + kv/a + f/h)/t (input, Q, V, attention out, w1 out and both reduce-scatter outputs, sharded);
    with TP and no SP the whole input and w2 output 4·sbh plus 2·sbh·(2 + kv/a + f/h)/t. Without FlashAttention both
    are Korthikanti's selective recomputation (the score term dropped).

    >>> activation_bytes_per_layer(2048, 1, 12288, 96, 8) / 2**20   # GPT-3 175B, t=8: 23·s·b·h
    552.0
    >>> activation_bytes_per_layer(8192, 2, 4096, 32, 1, attention_scores=False, checkpointing="torchtitan_op",
    ...                            ffn=14336, kv_heads=8) / (8192 * 2 * 4096)   # Llama 3.1 8B: 2·(4 + 1/4 + 3.5)
    15.5
    >>> activation_bytes_per_layer(8192, 2, 4096, 32, 1, attention_scores=False, checkpointing="selective",
    ...                            ffn=14336, kv_heads=8) / (8192 * 2 * 4096)   # runtime's: 2·(3 + 2 + 1/2 + 7)
    25.0
    """
    if checkpointing not in AC_KINDS:
        raise ValueError(
            f"activation_bytes_per_layer: `checkpointing={checkpointing!r}` must be one of {AC_KINDS}.")
    sbh = float(seq) * micro_batch * hidden
    kv = (heads if kv_heads is None else kv_heads) / heads
    sharded = 4.0 + 4.0 * kv + (16.0 if ffn is None else 6.0 * ffn / hidden)
    if checkpointing == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if checkpointing == "selective" and not attention_scores:  # meshkit's runtime: every matmul and attention output
        f = (4.0 * hidden if ffn is None else ffn) / hidden
        col = 2.0 + 2.0 * kv + f * (2.0 if ffn is not None else 1.0)  # q, attention out, k, v; w1 (and w3) outputs
        row = 3.0  # the block input and wo's, w2's outputs: whole on each TP rank, ÷ t with SP (reduce-scattered)
        return 2 * sbh * (row / (tp if sequence_parallel else 1) + col / tp)
    if checkpointing == "torchtitan_op" and not attention_scores:  # torchtitan's op-level SAC
        f = (4.0 * hidden if ffn is None else ffn) / hidden
        if tp == 1:
            return 2 * sbh * (4 + kv + f)
        if sequence_parallel:
            return 2 * sbh * (1 + (5 + kv + f) / tp)
        return 2 * sbh * (2 + (2 + kv + f) / tp)
    if checkpointing == "torchtitan_op":
        checkpointing = "selective"  # without FlashAttention: Korthikanti's selective (the scores dropped)
    scores = 5 * heads * seq / (hidden * tp) if attention_scores and checkpointing == "none" else 0.0
    whole = 10.0 if dropout else 8.0  # norms' inputs 4, QKV and MLP inputs 4, dropout masks 2
    if sequence_parallel:
        return sbh * ((whole + sharded) / tp + scores)
    return sbh * (whole + sharded / tp + scores)



# Roofline ridge (FLOP/byte) for a device outside GPU_TABLE: the H100 SXM's 295 (989.4 TFLOP/s over
