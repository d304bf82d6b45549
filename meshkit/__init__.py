"""meshkit: N-dimensional parallel training for PyTorch Lightning, and a profiler that says where MFU went."""

__version__ = "0.1.0"

__all__ = ["__version__"]
