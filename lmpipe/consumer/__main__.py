"""`python -m lmpipe.consumer ...` is `lmpipe train ...`."""

import sys

from lmpipe.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
