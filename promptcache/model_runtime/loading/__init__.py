"""Loading a model and laying out its weights at load time.

`loader.py` reads a Hugging Face causal LM (or the built-in default model, `default_model.py`), checks its
architecture and wraps it as a `LoadedModel`; on the way it may fuse decoder layers (`fused_layers.py`),
quantize linear layers (`quantization.py`, `quantized_linear.py`, GGUF blocks read by `gguf_weights.py`) and
prepack linear weights for oneDNN (`packed_linear.py`). Kept free of imports so importing one module does not
load the others.
"""
