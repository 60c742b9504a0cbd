"""Torch backend: float64 oracles, portable strict implementations, and stock baselines."""
