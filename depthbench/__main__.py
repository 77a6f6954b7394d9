import sys

from depthbench.cli import main

sys.exit(main())
