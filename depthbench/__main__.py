import sys

from depthbench.commands.cli import main

sys.exit(main())
