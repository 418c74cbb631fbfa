"""A classification head the model was trained with, and the data's classes
on it (--task hf, --hf_head sequence_classification): a label outside the
trained head's classes is one line naming the sample, unless --new_head."""
from __future__ import annotations

from textbox_like.core.errors import UserError


def fit_to_the_trained_head(raw, split, names, count, head, model_dir, label, new_head):
    """((class names or None, number of classes), the start line's note or
    None): the training split's classes on the model's trained head, its size
    and its names' order kept (a label outside it is one line naming the
    sample); with --new_head, or a model without such a head, the data's own,
    and the note says a new head is trained. ``head``: the model's trained
    head (tasks.hf.trained_head), or None."""
    from textbox_like.data.hf_text import first_row
    if head is None or new_head:
        same = head is not None and head[0] == count and (head[1] or None) == (names if head[1] else None)
        note = (f"--new_head: the model's trained head already has the data's {count} classes; kept"
                if same else f"new classification head: {count} classes"
                + (f" (the model's trained head of {head[0]} dropped: --new_head)" if head else ""))
        return (names, count), note
    trained, trained_names = head
    if names is None:   # class numbers
        allowed = range(trained)
        outside = count > trained
    else:
        allowed = trained_names or [str(i) for i in range(trained)]
        outside = (set(names) - set(allowed)) if trained_names else len(names) > trained
    if outside:
        if names is None:
            wrong = first_row(raw, label, lambda v: int(v) not in allowed)
        elif trained_names:
            wrong = first_row(raw, label, lambda v: str(v) not in allowed)
        else:
            wrong = first_row(raw, label, lambda v: sorted(names).index(str(v)) >= trained)
        shown = ", ".join(map(str, allowed[:6])) + (", ..." if len(allowed) > 6 else "")
        raise UserError(f"sample {wrong} of the {split!r} split has label {raw[wrong][label]!r}, not one of the "
                        f"{trained} classes the model's trained head has ({shown}; {model_dir}/config.json); "
                        f"fix the label, or pass --new_head to train a new head of the data's classes")
    if trained_names:
        return (list(trained_names), trained), None
    if names is not None:   # names on a head of numbered classes: its size kept
        return (names + [f"LABEL_{i}" for i in range(len(names), trained)], trained), None
    return (None, trained), None
