"""Kernels beside their torch references: the registry picks one per weight kind and device; affine/ is the
affine family with its plan of paths, cpu/ the CPU kernels, paged_kv the KV formats and cache writes."""
