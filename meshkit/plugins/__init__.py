"""meshkit.plugins"""
