"""Layer types beyond the core table: the library architectures a model node may name (library.py) and their
torch side (monai_nets.py)."""
