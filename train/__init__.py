"""Training of specd's learned drafter (an EAGLE-3 head for the target): data, split, the
self-distillation run through specd's own engine, and the training loop."""
