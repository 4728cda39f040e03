"""Board preset JSON files (package data; read by hwspec)."""
