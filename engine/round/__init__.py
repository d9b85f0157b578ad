"""One speculative round: the speculator (plan, propose, verify, accept, commit), the plan,
penalties, the rejection rule, draft trees (their rule and shape), the step's output."""
