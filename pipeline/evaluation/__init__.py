"""Evaluation: a model (or a scripted policy) on held-out benchmark tasks, through the synthesis agent loop."""
