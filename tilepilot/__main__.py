import sys

from tilepilot.cli import main

sys.exit(main())
