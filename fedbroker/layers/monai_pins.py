"""What both sides of a library node agree on, with no torch: the MONAI version fedbroker pins (requirements.txt)
and the ResNet layouts by depth. The allow-list (library.py) and the builders (monai_nets.py) read them."""

from __future__ import annotations

MONAI_VERSION = "1.6.1"
RESNET_LAYERS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}  # basic blocks per stage
RESNET_WIDTHS = (64, 128, 256, 512)
