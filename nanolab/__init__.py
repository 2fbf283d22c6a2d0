"""nanolab: a Llama-family inference engine built one day at a time.

The public surface is vLLM's offline API (`LLM`, `SamplingParams`); the pieces below it are
importable by name for the notebooks and tests.
"""

from nanolab.cache import BatchedCacheRows, BatchedPagedKVCache, BlockTable
from nanolab.config import PRESETS, ModelConfig
from nanolab.engine import Engine
from nanolab.llm import LLM, RequestOutput
from nanolab.model import LlamaModel, load_model
from nanolab.paged_attention import paged_attention_batched_reference
from nanolab.sampling import SamplingParams
from nanolab.weights import resolve_weights

__all__ = [
    "LLM", "PRESETS", "BatchedCacheRows", "BatchedPagedKVCache", "BlockTable", "Engine", "LlamaModel",
    "ModelConfig", "RequestOutput", "SamplingParams", "load_model", "paged_attention_batched_reference",
    "resolve_weights",
]
