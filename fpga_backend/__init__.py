"""fastcar_compile.fpga_backend."""
