import os

# Triton's interpreter must be chosen before any @triton.jit runs; kernels on CPU tensors use it in tests.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
