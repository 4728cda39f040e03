import sys

from fastcar_compile.cli import main

sys.exit(main())
