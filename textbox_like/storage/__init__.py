"""Storage: what reads and writes checkpoints and run files."""
