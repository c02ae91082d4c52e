"""``python -m pploader`` = the ``pploader`` command."""
import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while starting: one line, the shell's status, nothing written
    sys.stderr.write("pploader: interrupted (Ctrl-C)\n")
    sys.exit(130)

sys.exit(main())
