"""`python -m fedbroker`: the same CLI as the `fedbroker` script, for a checkout that is not installed."""

import sys

from fedbroker.app.cli import main

sys.exit(main())
