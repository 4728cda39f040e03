"""fastcar_compile.passes."""
