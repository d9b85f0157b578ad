"""The draft length K per row and round: the goodput rule, its evidence, the measured round cost,
probes, start-up calibration."""
