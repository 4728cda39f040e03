"""`python -m fastcar_compile`: the `fastcar-compile` console script, found through the entry point pyproject.toml
declares (the command line is the top layer; the package root, which the API shares, does not import it)."""

import sys
from importlib.metadata import entry_points

scripts = entry_points(group="console_scripts", name="fastcar-compile")
if not scripts:
    sys.exit("fastcar-compile: error: the package is not installed (no console script); run "
             "`python3 -m pip install -c constraints.txt -e .` in the repository")
sys.exit(next(iter(scripts)).load()())
