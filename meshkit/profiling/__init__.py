"""meshkit.profiling"""
