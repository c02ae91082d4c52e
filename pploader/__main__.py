"""``python -m pploader`` = the ``pploader`` command."""
import sys

from .cli import main

sys.exit(main())
