"""The product's face: the `fedbroker` command, process launchers, the demo, the privacy audit and status tables.

The kernel (`fedbroker/*.py`, `fedbroker/bus/`) never imports from here; this package imports the services.
"""
