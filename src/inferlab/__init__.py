"""inferlab: serve, measure and decide — an LLM inference engineering toolkit."""

__version__ = "0.1.0"

# The offline API is imported lazily so that `inferlab bench` (which must not depend on the engine)
# starts without importing torch.
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from inferlab.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from inferlab.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
