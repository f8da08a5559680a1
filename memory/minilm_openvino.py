"""The minilm graph on OpenVINO in bfloat16, where the CPU computes bfloat16 natively.

The graph is ``memory.minilm_onnx``'s own (the same cached ``.onnx`` file, built from the same
weights); only the runtime differs. On a CPU with native bfloat16 (AVX-512 BF16 or AMX: OpenVINO
reports ``BF16`` among its CPU capabilities) the matrix products read half the weight bytes and
run on the bfloat16 units, accumulating in fp32, so the vectors stay the reference's (worst
cosine 0.99997 on the shipped texts; tests/test_minilm_openvino.py holds it to 0.999) and one
short query costs about half of onnxruntime's fp32 pass (docs/selection-quality.md,
``python -m bench.embedcost``). Elsewhere OpenVINO would run fp32 and lose to onnxruntime, so
``IBEX_MEMORY_MINILM_RUNTIME=auto`` picks it only where bfloat16 is native.

One thread, one stream, latency hint: the memory service embeds in a worker thread next to its
event loop, on a box it shares with the workers. An infer request is not thread-safe, so each
calling thread gets its own from the one compiled model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

PRECISION = "bf16"


def openvino_available() -> bool:
    """True when the openvino package is installed."""
    return importlib.util.find_spec("openvino") is not None


@cache
def bf16_native() -> bool:
    """True when OpenVINO is installed and this CPU computes bfloat16 natively."""
    if not openvino_available():
        return False
    import openvino as ov

    try:
        caps = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except RuntimeError as exc:  # no CPU plugin
        log.warning("minilm: openvino has no CPU device: %s", exc)
        return False
    return "BF16" in caps


def _config(precision: str) -> dict[str, Any]:
    return {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": precision}


class OpenVinoSession:
    """What ``memory.minilm_onnx.OnnxMiniLM`` asks of an onnxruntime session (``run``), over an
    OpenVINO model compiled from the graph's ``.onnx`` file (a path, or the serialised bytes)."""

    def __init__(self, model: str | bytes, precision: str = PRECISION) -> None:
        import openvino as ov

        core = ov.Core()
        if isinstance(model, bytes):  # an unwritable cache: read through a private temporary file
            fd, path = tempfile.mkstemp(suffix=".onnx")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(model)
                self.compiled = core.compile_model(core.read_model(path), "CPU", _config(precision))
            finally:
                os.unlink(path)
        else:
            self.compiled = core.compile_model(model, "CPU", _config(precision))
        self.precision: str = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()  # "bf16", "f32"
        self._local = threading.local()

    def run(self, outputs: Sequence[str], feeds: Mapping[str, Any]) -> list[Any]:
        """The named outputs, copied out of the request's buffers (the next call reuses them)."""
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        result = request.infer(dict(feeds))
        return [np.array(result[self.compiled.output(name)], dtype=np.float32) for name in outputs]
