"""Models built by tasks (imported lazily by the tasks that use them)."""
