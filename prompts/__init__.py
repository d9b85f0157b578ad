"""The real prompt sets (MT-Bench, HumanEval) and their encoding: ``prompts.sets``. Imports nothing
of specd: the engine's tests, the drafter's training and the load generator all read them here."""
