"""What the embedders are configured with (``memory.embedders.embed.load_embedder``).

The memory service fills it from its settings (``MemoryConfig.embedder_config``); the defaults are
those settings' defaults, so a caller without settings (a bench, a test) gets the service's
embedder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What may run minilm's forward pass (IBEX_MEMORY_MINILM_RUNTIME): ``auto`` is OpenVINO where it is
# installed (bfloat16 where the CPU computes it natively, else f32), else the numpy reference.
MINILM_RUNTIMES = ("auto", "openvino", "numpy")
MinilmRuntime = Literal["auto", "openvino", "numpy"]
MinilmWeights = Literal["auto", "fp32", "int8-groups"]


@dataclass(frozen=True, slots=True)
class EmbedderConfig:
    """The embedder's part of the memory service's settings (``IBEX_MEMORY_*``)."""

    minilm_runtime: str = "auto"  # one of MINILM_RUNTIMES; anything else is refused by load_embedder
    minilm_weights: MinilmWeights = "auto"
    embed_url: str | None = None  # the ``openai`` embedder's endpoint
    embed_model: str = ""
    embed_api_key: str | None = None
    embed_dim: int | None = None
    embed_min_similarity: float = 0.30
    embed_timeout_s: float = 2.0
    max_query_chars: int = 1_000
