"""The one exception type for mistakes a user can fix.

Raised anywhere; caught at the entry points, which print its message as one
line and exit with code 2 (no traceback).
"""


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""


def first_line(exc, limit=None, empty=None) -> str:
    """The first line of an exception's message (of a text, given one),
    cut to ``limit`` characters; an empty message gives ``empty``, or the
    exception's type name: never an IndexError on an empty message."""
    lines = str(exc).strip().splitlines()
    if lines:
        return lines[0][:limit]
    return (type(exc).__name__ if empty is None else empty)[:limit]


def _norm(text):
    return str(text).lstrip("-").lower().replace("_", "-")


def _distance(a, b):
    """Edit distance with transpositions (optimal string alignment). Not
    difflib's ratio: that one takes --end-learning-rate for a near miss of
    --learning-rate, because they share a long run of letters."""
    prev2, prev = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _budget(word):
    """How many typing mistakes a near miss of this length may hold."""
    n = len(word)
    return 1 if n <= 4 else 2 if n <= 12 else 3


def closest_match(word, choices):
    """The valid choice ``word`` is a near miss of, or None.

    A near miss is a few typing mistakes away (case, ``-``/``_`` ignored), or
    a unique abbreviation. Choices that merely share a word with it
    (``--learning-rate`` and ``--end-learning-rate``) are different options,
    not suggestions."""
    choices = [str(c) for c in choices]
    if not choices:
        return None
    target = _norm(word)
    if not target:
        return None
    scored = []
    for choice in choices:
        norm = _norm(choice)
        d = _distance(target, norm)
        if d <= _budget(target) and d < len(norm):
            # prefer the spelling the user typed (dashes or underscores)
            scored.append((d, _distance(str(word), choice), choice))
    if scored:
        return min(scored)[2]
    if len(target) >= 3:
        prefixed = {_norm(c): c for c in choices if _norm(c).startswith(target)}
        if len(prefixed) == 1:
            return next(iter(prefixed.values()))
    return None


def nearest(word, choices):
    """The choice with the fewest typing mistakes from ``word`` (None when
    there are no choices): for messages that always name one."""
    choices = [str(c) for c in choices]
    target = _norm(word)
    return min(choices, key=lambda c: (_distance(target, _norm(c)), c), default=None)


def closest(word, choices):
    """' (did you mean X?)' for the closest valid choice, or ''."""
    match = closest_match(word, choices)
    return f" (did you mean {match!r}?)" if match else ""


def unknown(kind, word, choices):
    choices = sorted(choices)
    return UserError(f"unknown {kind} {word!r}{closest(word, choices)}; choose from: {', '.join(map(str, choices))}")


#: notes are muted while a saved configuration is re-resolved (evaluation of a
#: checkpoint): they were said to the run that wrote it
_muted = []


class notes_muted:
    """``with notes_muted(): ...``: no note lines inside."""

    def __enter__(self):
        _muted.append(True)

    def __exit__(self, *exc):
        _muted.pop()


def say(line):
    """``line`` and its newline on stderr in ONE write, flushed. ``print``
    writes the text and the newline apart, and a signal handler that prints
    (Ctrl-C's announcement) runs between any two bytecodes: its line landed
    inside a progress line (``... wall 0.9285interrupted (Ctrl-C)...``)."""
    import sys
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def note(message):
    """One line on stderr, from the first process only."""
    import os
    if _muted:
        return
    if os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0":
        say(f"note: {message}")
