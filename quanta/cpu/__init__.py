"""The CPU kernels: torch's packed int4 and int8 GEMMs, batch-invariant float matmul and paged attention."""
