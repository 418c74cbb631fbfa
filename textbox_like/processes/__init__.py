"""Ranks and process groups, the torchrun agent's hand-off notes, signals."""
