"""Experiment scripts that measure the lineage's claims (each writes JSON + a PNG)."""
