"""fastcar_compile.runtime."""
