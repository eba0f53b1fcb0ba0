"""Whole-checkpoint tools built on the loaders, writers and quantizers (conversion between formats)."""
