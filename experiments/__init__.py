"""Experiment scripts that measure the seeds' claims (each writes JSON + a PNG)."""
