"""`python -m lmpipe.producer ...` is `lmpipe produce ...`."""

import sys

from lmpipe.cli import main

sys.exit(main(["produce", *sys.argv[1:]]))
