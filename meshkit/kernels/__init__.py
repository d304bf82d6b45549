"""meshkit.kernels"""
