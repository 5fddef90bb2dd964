import sys

from lmpipe.cli import main

sys.exit(main())
