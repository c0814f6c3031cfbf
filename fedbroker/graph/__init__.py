"""The model graph as data: named nodes from the layer table, merge nodes, reusable blocks, expanded and
checked (names, references, cycles, shapes, bounds) without torch, so the coordinator refuses a bad graph at
submission and a site can read its cost before it trains."""
