"""What turns logits into a draw, shared by the target's round and the drafters: temperature,
top-k / top-p and the exponential race (probs.py), grammar masks (grammar.py)."""
