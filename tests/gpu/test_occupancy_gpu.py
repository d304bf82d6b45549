"""On a GPU: the offline (CPU-compiled) figures equal what the driver reports for the loaded kernel.

Checks, for this device's arch: registers == the loaded kernel's ``n_regs``, local bytes / 4 ==
``n_spills``, Triton's dynamic shared memory, CUDA's own occupancy API
(``cuOccupancyMaxActiveBlocksPerMultiprocessor``) == our ``active_blocks_per_sm``, the device
properties == the arch table, and the ``TritonKernelReport`` callback records the kernel a training
run launched, with its grid-independent occupancy.

The kernels run compiled, so the body runs in a subprocess without ``TRITON_INTERPRET`` (the test
suite's conftest turns the interpreter on).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from meshkit.profiling.occupancy import ARCHS, GPUS, kernel_occupancy
from tests.fixtures.occupancy_kernels import matmul_kernel, row_sum_squares

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_SCRIPT = r'''
import ctypes, json, sys
import torch, lightning as L
from meshkit.profiling.occupancy import TritonKernelReport
from tests.fixtures.occupancy_kernels import matmul_kernel, row_sum_squares

cuda = ctypes.CDLL("libcuda.so.1")

def driver_blocks(compiled, num_warps):
    n = ctypes.c_int(0)
    rc = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(compiled.function),
                                                         ctypes.c_int(32 * num_warps),
                                                         ctypes.c_size_t(compiled.metadata.shared))
    assert rc == 0, rc
    return n.value

out = {}
x = torch.randn(64, 1000, device="cuda")
y = torch.empty(64, device="cuda")
k = row_sum_squares[(64,)](x, y, 1000, x.stride(0), BLOCK=1024, num_warps=4)
torch.testing.assert_close(y, (x * x).sum(1))
out["reduction"] = dict(n_regs=k.n_regs, n_spills=k.n_spills, shared=k.metadata.shared,
                        driver_blocks=driver_blocks(k, 4))

a = torch.randn(512, 512, device="cuda", dtype=torch.float16)
b = torch.randn(512, 512, device="cuda", dtype=torch.float16)
c = torch.empty(512, 512, device="cuda", dtype=torch.float16)
k = matmul_kernel[(16,)](a, b, c, 512, 512, 512, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                         c.stride(0), c.stride(1), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8,
                         num_warps=8, num_stages=4)
torch.testing.assert_close(c.float(), (a.float() @ b.float()), atol=0.5, rtol=1e-2)
out["matmul"] = dict(n_regs=k.n_regs, n_spills=k.n_spills, shared=k.metadata.shared,
                     driver_blocks=driver_blocks(k, 8))

class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(64, 1000))
    def training_step(self, batch, i):
        (xb,) = batch
        yb = torch.empty(xb.shape[0], device=xb.device)
        row_sum_squares[(xb.shape[0],)](xb, yb, xb.shape[1], xb.stride(0), BLOCK=1024, num_warps=4)
        return (self.w[: xb.shape[0]] * xb).pow(2).mean() + 0 * yb.sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

cap = torch.cuda.get_device_capability()
cb = TritonKernelReport(archs=[f"sm_{cap[0]}{cap[1]}"], cache_dir=sys.argv[1])
data = torch.utils.data.TensorDataset(torch.randn(128, 1000))
trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=3, callbacks=[cb], logger=False,
                    default_root_dir=sys.argv[1],
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(M(), torch.utils.data.DataLoader(data, batch_size=32))
out["callback"] = dict(launches=cb.launches, grids={k: [[list(g), n] for g, n in c.items()]
                                                    for k, c in cb.grids.items()},
                      kernels=[[r.kernel, r.arch, r.num_warps, r.registers_per_thread] for r in cb.reports],
                      wave_blocks=[sorted({w.blocks for w in r.waves}) for r in cb.reports])
p = torch.cuda.get_device_properties(0)
out["device"] = dict(name=p.name, sms=p.multi_processor_count, cap=list(cap),
                     threads_per_sm=p.max_threads_per_multi_processor,
                     regs_per_sm=getattr(p, "regs_per_multiprocessor", None),
                     smem_per_sm=getattr(p, "shared_memory_per_multiprocessor", None),
                     smem_per_block_optin=getattr(p, "shared_memory_per_block_optin", None))
print(json.dumps(out))
'''

MM_SIG = {"A": "*fp16", "B": "*fp16", "C": "*fp16", "M": "i32:16", "N": "i32:16", "K": "i32:16",
          "stride_am": "i32:16", "stride_bk": "i32:16", "stride_cm": "i32:16"}
MM_CONST = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "stride_ak": 1, "stride_bn": 1,
            "stride_cn": 1}


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("occ"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.getcwd()
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, cache], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), cache


def _arch(run):
    major, minor = run["device"]["cap"]
    arch = f"sm_{major}{minor}"
    if arch not in ARCHS:
        pytest.fail(f"device arch {arch} is not in the occupancy table ({', '.join(ARCHS)}): add a row")
    return arch


def test_offline_registers_spills_and_shared_equal_the_loaded_kernel(gpu_run):
    run, cache = gpu_run
    arch = _arch(run)
    (red,) = kernel_occupancy(row_sum_squares, signature="X=*fp32,OUT=*fp32,N=i32,stride=i32",
                              constexprs={"BLOCK": 1024}, num_warps=4, archs=[arch], cache_dir=cache)
    (mm,) = kernel_occupancy(matmul_kernel, signature=MM_SIG, constexprs=MM_CONST, num_warps=8, num_stages=4,
                             archs=[arch], cache_dir=cache)
    for rep, got in ((red, run["reduction"]), (mm, run["matmul"])):
        assert rep.registers_per_thread == got["n_regs"], (rep.kernel, arch)
        assert rep.local_bytes // 4 == got["n_spills"]
        assert rep.dynamic_shared_bytes == got["shared"]
        # CUDA's own occupancy calculator on the loaded function
        assert rep.occupancy.active_blocks_per_sm == got["driver_blocks"], (rep.kernel, rep.occupancy)


def test_device_properties_match_the_table(gpu_run):
    run, _ = gpu_run
    spec = ARCHS[_arch(run)]
    dev = run["device"]
    assert dev["threads_per_sm"] == spec.max_threads_per_sm
    if dev["regs_per_sm"] is not None:
        assert dev["regs_per_sm"] == spec.registers_per_sm
    if dev["smem_per_sm"] is not None:
        assert dev["smem_per_sm"] == spec.shared_per_sm_bytes
    if dev["smem_per_block_optin"] is not None:
        assert dev["smem_per_block_optin"] == spec.shared_per_block_bytes
    models = [g for g in GPUS.values() if g.arch == spec.name and g.name.split("-")[0] in dev["name"]]
    if models:
        assert dev["sms"] in {g.sms for g in models}, (dev["name"], dev["sms"])


def test_callback_records_the_launched_kernel(gpu_run):
    run, _ = gpu_run
    cb = run["callback"]
    assert cb["launches"].get("row_sum_squares") == 3
    # batches of 32 rows, one program per row, on every one of the 3 steps
    assert cb["grids"]["row_sum_squares"] == [[[32, 1, 1], 3]]
    assert cb["wave_blocks"] == [[32]]
    assert [k[:3] for k in cb["kernels"]] == [["row_sum_squares", _arch(run), 4]]
    # the callback's offline figure for the run's own specialisation equals the loaded kernel's registers
    assert cb["kernels"][0][3] == run["reduction"]["n_regs"]
