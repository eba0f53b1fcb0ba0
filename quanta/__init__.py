"""quanta: a quantization-centric LLM inference engine and model-conversion toolkit."""
from quanta.quant.errors import QuantaError

__version__ = "0.1.0"


def __getattr__(name):
    # The engine pulls in torch models and transformers; import it only when asked for.
    if name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput"):
        import quanta.engine as engine
        return getattr(engine, name)
    if name == "plan":
        from quanta.engine.memory_plan import plan
        return plan
    if name == "convert":
        from quanta.toolkit.convert import convert
        return convert
    if name == "validate":
        from quanta.eval import validate
        return validate
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "QuantaError", "plan", "validate", "convert"]
