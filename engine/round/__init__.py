"""One speculative round's math: plan, sampling, penalties, grammar, forced tokens, the rejection
rule, the step's output."""
