"""The one exception type for mistakes a user can fix.

Raised anywhere; caught at the entry points, which print its message as one
line and exit with code 2 (no traceback).
"""
import difflib


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""


def closest(word, choices):
    """' (did you mean X?)' for the closest valid choice, or ''."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def unknown(kind, word, choices):
    choices = sorted(choices)
    return UserError(f"unknown {kind} {word!r}{closest(word, choices)}; choose from: {', '.join(map(str, choices))}")
