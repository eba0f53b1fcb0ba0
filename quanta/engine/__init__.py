"""The inference engine: LLM, SamplingParams and vLLM-shaped outputs."""
from quanta.engine.llm import LLM
from quanta.engine.outputs import CompletionOutput, Logprob, RequestOutput
from quanta.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
