import sys

from fedbroker.cli import main

sys.exit(main())
