import sys

from difftrain.cli.app import main

sys.exit(main())
