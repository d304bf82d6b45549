"""TritonKernelReport on CPU: the run launches a Triton kernel through the interpreter, which compiles
nothing, so the report is empty and says why (GPU runs are checked in tests/gpu/test_occupancy_gpu.py)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from meshkit.profiling.occupancy import TritonKernelReport
from tests.fixtures.occupancy_kernels import row_sum_squares


class _SumSquaresModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 64))
        self.kernel_calls = 0

    def training_step(self, batch, batch_idx):
        x = batch[0]
        out = torch.empty(x.shape[0])
        row_sum_squares[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=64)  # interpreted on CPU
        self.kernel_calls += 1
        torch.testing.assert_close(out, (x * x).sum(1))
        return ((self.w * x) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_cpu_run_reports_no_compiled_kernels_honestly(tmp_path):
    from triton import knobs
    from triton.compiler.compiler import CompiledKernel

    launch_metadata = CompiledKernel.launch_metadata
    data = torch.utils.data.TensorDataset(torch.randn(8, 64))
    cb = TritonKernelReport(archs=["sm_90"], cache_dir=str(tmp_path / "cache"))
    module = _SumSquaresModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2,
                        logger=TensorBoardLogger(str(tmp_path), name="run"), callbacks=[cb],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert module.kernel_calls == 2
    assert cb.kernels == {} and cb.launches == {} and cb.grids == {} and cb.reports == []
    assert "no Triton kernels were compiled or launched" in cb.note and "TRITON_INTERPRET=1" in cb.note
    # hooks are gone after fit
    assert knobs.runtime.jit_post_compile_hook is None
    assert cb._on_launch not in knobs.runtime.launch_enter_hook.calls
    assert CompiledKernel.launch_metadata is launch_metadata

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(trainer.logger.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("occupancy/table/text_summary")
    assert "TRITON_INTERPRET=1" in event.tensor_proto.string_val[0].decode()


def test_unknown_arch_fails_at_fit_start(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(8, 64))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                        callbacks=[TritonKernelReport(archs=["sm_75"])], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = _SumSquaresModule()
    with pytest.raises(ValueError, match="Unknown arch='sm_75'"):
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert module.kernel_calls == 0  # raised before the first step
