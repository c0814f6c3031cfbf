import sys

from fedbroker.app.cli import main

sys.exit(main())
