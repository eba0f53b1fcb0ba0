"""Typed errors for bad user input: corrupt files, unsupported formats, wrong config values."""


class QuantaError(Exception):
    """Base of every error quanta raises for input it cannot use. The message names what is wrong."""


class CorruptFileError(QuantaError):
    """A checkpoint file is truncated, has a bad header, or its contents contradict its own metadata."""


class UnsupportedError(QuantaError):
    """A well-formed input asks for something quanta does not support (architecture, quant type, ...)."""


class ConfigError(QuantaError):
    """A configuration value (user argument or checkpoint config field) is missing or invalid."""


class ShapeError(QuantaError):
    """Tensors of one quantized weight disagree with each other or with the declared shape."""
