"""Chunk-causal video diffusion transformers (Wan2.1-style): the model, its ONNX export and the streaming
runtime. A layer above the ground-level modules: it may import torch and them; passes/, runtime/ and
fpga_backend/ never import it."""
