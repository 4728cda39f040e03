"""`python -m fastcar_compile`: the `fastcar-compile` console script, found through the entry point pyproject.toml
declares (the command line is the top layer; the package root, which the API shares, does not import it)."""

import sys
from importlib.metadata import entry_points

(script,) = entry_points(group="console_scripts", name="fastcar-compile")
sys.exit(script.load()())
