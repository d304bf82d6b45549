"""Pipeline parallelism on ``torch.distributed.pipelining``: stage split, placement, schedules, timeline.

One call turns a layer-stack model into this rank's pipeline stages and a torch schedule::

    pipe = build_pipeline(model, pp_mesh, schedule="1f1b", batch_size=8)   # every pp rank
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipeline_step(pipe, tokens, labels)   # forward + backward over micro-batches
    opt.step(); opt.zero_grad()                  # loss: the mean over micro-batches, same on every rank

- **Split** (:func:`find_layer_stack`, :func:`balanced_split_points`): the repeated blocks
  (``layers`` / ``model.layers``) are cut into ``pp × v`` contiguous stages balanced by a cost model
  (parameters or matmul FLOPs per block, the embedding charged to the first stage and the final
  norm + head to the last, so those get fewer blocks); ``split_points`` overrides. Each stage is a
  copy of the model with the other stages' blocks removed and the pieces it does not own set to
  None, so parameter FQNs are the full model's. Its ``forward`` is a stage forward for the model's
  family (meshkit ``Transformer``, HF Llama-family ``*ForCausalLM``) that skips the None pieces and
  rebuilds positions 0..T-1 (rotary angles, causal mask) on every stage; torchtitan-style models
  keep their own forward, which already skips None modules.
- **Placement** (:func:`stage_ids_on_rank`): looped, rank r holds stages r + s·pp; "V" for
  ``zbv_zero_bubble`` and ``dualpipev`` (rank r holds r and 2·pp-1-r).
- **Schedules** (:data:`SCHEDULES`): gpipe, 1f1b (one stage per rank); interleaved_1f1b,
  looped_bfs, interleaved_zero_bubble, zbv_zero_bubble, dualpipev (``virtual_stages`` per rank,
  default 2). Micro-batches: :func:`resolve_microbatches`.
- **Loss**: the last stage computes ``loss_fn(output, labels)`` per micro-batch (default: token-mean
  cross-entropy over logits). The schedule divides gradients by m, so with a mean loss and equal
  micro-batches the gradients equal one process's full-batch gradients.
- **Timeline**: with ``timeline_dir`` every F/B/I/W action is written to
  ``pp_timeline_rank{R}.jsonl``; the format (and the one reader) is :mod:`meshkit.timeline`,
  see also ``docs/pipeline.md``.

Modules: :mod:`~meshkit.plugins.pipeline.schedule` (torch classes, placement, micro-batches; the
vocabulary and bubble theory are :mod:`meshkit.schedules`), :mod:`~meshkit.plugins.pipeline.split`,
:mod:`~meshkit.plugins.pipeline.runtime`, :mod:`~meshkit.plugins.pipeline.lightning` (the strategy's
pp > 1 hooks; not imported here).
"""

from meshkit.plugins.pipeline.runtime import (
    Pipeline,
    build_pipeline,
    causal_lm_loss,
    make_pipeline,
    pipeline_eval,
    pipeline_step,
    plan_split,
    split_model,
)
from meshkit.plugins.pipeline.schedule import (
    SCHEDULES,
    resolve_microbatches,
    resolve_virtual_stages,
    schedule_spec,
    stage_ids_on_rank,
    stage_rank,
    theoretical_bubble,
)
from meshkit.plugins.pipeline.split import (
    STAGE_FORWARDS,
    LayerStack,
    balanced_split_points,
    build_rank_module,
    find_layer_stack,
    stage_view,
)
from meshkit.timeline import TIMELINE_FIELDS, TIMELINE_FILE, TimelineRecorder, read_timeline

__all__ = [
    "SCHEDULES",
    "STAGE_FORWARDS",
    "TIMELINE_FIELDS",
    "TIMELINE_FILE",
    "LayerStack",
    "Pipeline",
    "TimelineRecorder",
    "balanced_split_points",
    "build_pipeline",
    "build_rank_module",
    "causal_lm_loss",
    "find_layer_stack",
    "make_pipeline",
    "pipeline_eval",
    "pipeline_step",
    "plan_split",
    "read_timeline",
    "resolve_microbatches",
    "resolve_virtual_stages",
    "schedule_spec",
    "split_model",
    "stage_view",
    "stage_ids_on_rank",
    "stage_rank",
    "theoretical_bubble",
]
