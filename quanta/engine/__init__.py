"""The inference engine: LLM (the offline API), EngineCore (what every driver runs), SamplingParams and
vLLM-shaped outputs."""
from quanta.engine.core import EngineCore
from quanta.engine.llm import LLM
from quanta.engine.outputs import CompletionOutput, Logprob, RequestOutput
from quanta.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineCore", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
