"""Triton kernels for nanolab's attention and decode paths."""
