"""Kernels (installed as `tokstream.kernels`).

CPU: `cpu_attention` and `cpu_prefill_attention` (C decode and prefill attention over the
paged pool, compiled on first use), and the C products and fused small ops. GPU: the Triton
kernels `paged_decode_attention`, `paged_prefill_attention`, `kv_cache_write`, `rms_norm` and
`rotary`, each with a torch `reference` and its shape/stride contract in its docstring;
`triton_backend` plugs them into the model, `check` tests them on a device.
"""
