"""The ground layer: the contract, errors, options, limits and file I/O that every other folder builds on.

Nothing here imports a module outside `fastcar_compile.core`, so passes/, runtime/, fpga_backend/, the FAST-AR
reference and the front door can all depend on it without a cycle (the layer order: tests/test_layers.py).
"""
