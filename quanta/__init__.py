"""quanta: a quantization-centric LLM inference engine and model-conversion toolkit."""
from quanta.quant.errors import QuantaError
from quanta.version import quanta_version

__version__ = quanta_version()


def __getattr__(name):
    # The engine pulls in torch models and transformers; import it only when asked for.
    if name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput"):
        import quanta.engine as engine
        return getattr(engine, name)
    if name == "plan":
        from quanta.planner.memory_plan import plan
        return plan
    if name == "PlanRequest":
        from quanta.planner.request import PlanRequest
        return PlanRequest
    if name == "LoRARequest":
        from quanta.lora.request import LoRARequest
        return LoRARequest
    if name == "convert":
        from quanta.toolkit.convert.pipeline import convert
        return convert
    if name == "validate":
        from quanta.eval import validate
        return validate
    if name == "bench":
        from quanta.toolkit.bench.pipeline import bench
        return bench
    if name == "quantize":
        from quanta.toolkit.quantize.pipeline import quantize
        return quantize
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "QuantaError", "plan", "PlanRequest",
           "LoRARequest", "quantize", "validate", "convert", "bench"]
