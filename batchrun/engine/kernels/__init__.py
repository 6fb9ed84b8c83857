"""Attention kernels and their checks: NVRTC, decode, prefix and host attention, shared-prefix
attention, first-use compiles. They import only the engine's base (types, config, stats,
memory) and each other."""
