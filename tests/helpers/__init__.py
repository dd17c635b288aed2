"""What tests share and do not test: the serve harness with test extras, recorded streams,
exported-series readers, workloads, replayed `top` frames, the Triton interpreter switch.
Imported as `from helpers.serving import ...` (pytest puts tests/ on the path)."""
