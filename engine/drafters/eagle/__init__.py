"""The EAGLE-3 drafter: its head (weights, files), one draft step, its captured graphs, its 4-bit
matrices."""
