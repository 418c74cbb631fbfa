"""Meters, experiment trackers, text metrics, curves."""
