import sys

from loka_tune.cli import main

sys.exit(main())
