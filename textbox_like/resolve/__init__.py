"""From a command line (or Python settings) to a checked RunConfig: the one layer that knows every registry."""
