"""Errors, faults and small leaves that import nothing of ours but each other."""
