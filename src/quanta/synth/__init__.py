"""Random-weight models with the exact shapes, metadata and tokenizer kind of real ones (``quanta synth``)."""

from quanta.synth.model import SynthResult, synthesize, tensor_shapes
from quanta.synth.presets import PRESETS, ModelPreset, get_preset

__all__ = ["PRESETS", "ModelPreset", "SynthResult", "get_preset", "synthesize", "tensor_shapes"]
