"""Training under context parallelism equals one process: the demo Transformer and a transformers Llama.

Plain torch loops, no Lightning: every rank trains the cp=4 model on its shard of each batch (global
positions from ``shard_batch``), averages gradients over the cp group (each rank's loss is the mean
over the same number of tokens, so the average of the local means is the global mean, and the
average of the local gradients the global gradient) and steps AdamW. The same rank also trains an
unsharded copy on the whole batch, with no communication; the losses must agree within rtol 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_pool import ProcessPool

STEPS = 3
SEQ = 32  # 2·cp = 8 chunks of 4 tokens
_MESH: list = []


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4) as p:
        yield p


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)))
    return _MESH[0]


def _step(model, opt, logits_fn, batch, group=None):
    logits = logits_fn(model, batch)
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    opt.zero_grad()
    loss.backward()
    loss = loss.detach().clone()
    if group is not None:
        for p in model.parameters():  # as FSDP over dp_shard×cp does: average the gradients over the cp ranks
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
    opt.step()
    return loss.item()


def _train(make_model, logits_fn, attention):
    from meshkit.models.llama import synthetic_tokens
    from meshkit.plugins.context_parallel import apply_context_parallel, shard_batch

    mesh = _mesh()
    torch.manual_seed(0)
    ref_model, cp_model = make_model(), make_model()
    cp_model.load_state_dict(ref_model.state_dict())
    apply_context_parallel(cp_model, mesh, attention=attention)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    cp_opt = torch.optim.AdamW(cp_model.parameters(), lr=1e-2)
    data = synthetic_tokens(2 * STEPS, SEQ, 256, seed=1)
    ref_losses, cp_losses = [], []
    for step in range(STEPS):
        tokens = data[2 * step : 2 * step + 2]  # (B=2, T+1)
        full = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "positions": torch.arange(SEQ).expand(2, -1)}
        ref_losses.append(_step(ref_model, ref_opt, logits_fn, full))
        cp_losses.append(_step(cp_model, cp_opt, logits_fn, shard_batch(tokens, mesh), mesh.get_group()))
    return ref_losses, cp_losses, cp_model


def _demo_model():
    from meshkit.models.llama import LlamaConfig, Transformer

    return Transformer(LlamaConfig.tiny(n_layers=2))


def _demo_logits(model, batch):
    return model(batch["input_ids"], batch["positions"])


def _body_demo(rank, world_size, attention):
    from meshkit.models.llama import synthetic_tokens
    from meshkit.plugins.context_parallel import shard_batch

    ref, got, model = _train(_demo_model, _demo_logits, attention)
    # Without explicit positions the model is fed the global ones of its tokens, not 0..T/cp-1.
    local = shard_batch(synthetic_tokens(2, SEQ, 256, seed=2), _mesh())
    same = torch.equal(model(local["input_ids"]), model(local["input_ids"], local["positions"]))
    return ref, got, same


@pytest.mark.parametrize("attention", ["ring", "allgather", "ulysses"])
def test_demo_transformer_cp4_trains_like_one_process(pool, attention):
    for ref, got, same_without_positions in pool.run(_body_demo, attention):
        assert ref[-1] < ref[0]  # it learns: the comparison is over moving weights
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)
        assert same_without_positions


def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _hf_logits(model, batch):
    return model(input_ids=batch["input_ids"], position_ids=batch["positions"]).logits


def _body_hf(rank, world_size, attention):
    ref, got, model = _train(_hf_model, _hf_logits, attention)
    return ref, got, model.config._attn_implementation


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_transformers_llama_cp4_trains_like_one_process(pool, attention):
    for ref, got, impl in pool.run(_body_hf, attention):
        assert impl.startswith(f"meshkit_cp_{attention}")
        assert ref[-1] < ref[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)


def _body_shard_batch(rank, world_size):
    from meshkit.plugins.context_parallel import gather_sequence, shard_batch

    mesh = _mesh()
    tokens = torch.arange(17).expand(2, -1)  # T+1 = 17: inputs 0..15, labels 1..16
    lb = shard_batch(tokens, mesh)
    flat = shard_batch({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}, mesh, layout="contiguous")
    with pytest.raises(ValueError, match=r"`input_ids.shape\[1\]=12` must be divisible by 2·cp=8"):
        shard_batch(torch.zeros(2, 13, dtype=torch.long), mesh)
    back = gather_sequence(lb["labels"], mesh)
    return lb["input_ids"][0].tolist(), lb["labels"][0].tolist(), lb["positions"][1].tolist(), flat["positions"][0].tolist(), back


def test_shard_batch_layouts(pool):
    results = pool.run(_body_shard_batch)
    # 16 tokens, 8 chunks of 2: rank r holds chunks r and 7-r.
    expected_lb = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    for rank, (inputs, labels, positions, flat_positions, back) in enumerate(results):
        assert inputs == expected_lb[rank]
        assert positions == expected_lb[rank]
        assert labels == [t + 1 for t in expected_lb[rank]]
        assert flat_positions == list(range(4 * rank, 4 * rank + 4))
        assert torch.equal(back, torch.arange(1, 17).expand(2, -1))
