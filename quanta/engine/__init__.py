"""The inference engine: LLM (the offline API), EngineCore (what every driver runs), SamplingParams and
vLLM-shaped outputs. SamplingParams and the outputs import without torch; the rest on first use."""
from quanta.engine.outputs import CompletionOutput, Logprob, RequestOutput
from quanta.engine.sampling_params import SamplingParams


def __getattr__(name):
    if name == "LLM":
        from quanta.engine.llm import LLM
        return LLM
    if name == "EngineCore":
        from quanta.engine.core import EngineCore
        return EngineCore
    raise AttributeError(name)


__all__ = ["LLM", "EngineCore", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
