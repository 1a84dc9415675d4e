"""Quantized weights: the formats kvray reads (GGUF blocks, AWQ/GPTQ, FP8, online int8)
converted into :class:`~kvray.quant.tensor.QuantTensor`, and the kernels' one-tensor blob."""
