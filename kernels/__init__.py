"""Triton kernels for the GPU path (installed as `tokstream.kernels`).

The CPU path uses the plain torch reference in `tokstream.worker.attention`; the kernels that
replace it on CUDA arrive with the GPU work and are always tested against that reference.
"""
