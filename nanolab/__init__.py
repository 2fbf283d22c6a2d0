"""nanolab: a Llama-family inference engine built one day at a time.

The public surface is vLLM's offline API (`LLM`, `SamplingParams`) and the `EngineConfig` every
choice goes through; `Engine` and the model loader
are importable here for the notebooks and tests. The book's instruments live in `nanolab.lab`,
which imports the engine and is never imported by it.
"""

from nanolab.config import EngineConfig
from nanolab.engine.llm_engine import Engine
from nanolab.llm import LLM, RequestOutput
from nanolab.model.config import PRESETS, ModelConfig
from nanolab.model.llama import LlamaModel, load_model
from nanolab.model.weights import resolve_weights
from nanolab.sampling import SamplingParams

__all__ = ["LLM", "PRESETS", "Engine", "EngineConfig", "LlamaModel", "ModelConfig", "RequestOutput", "SamplingParams",
           "load_model",
           "resolve_weights"]
