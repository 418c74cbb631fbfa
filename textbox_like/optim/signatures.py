"""The constructor defaults of torch.optim's classes, read once from one
torch version's signatures and kept here, so that resolving a command line
(a search's driver resolving each trial, ``--print_config``, a refused
command) does not import torch (about 1.7 s of a 2-core machine) only to
read them. Used only where the installed torch is this version (its package
metadata says so without importing it) and the optimizer is torch's own
class; anywhere else the signature is read from torch itself.

A unit test compares this table with torch's signatures; after a torch
upgrade, rewrite it with
``python -c "from textbox_like.optim import signatures; signatures.rewrite()"``.
"""
import inspect
import sys

#: every optimizer class of torch.optim (a test checks this list against torch)
TORCH_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon",
                    "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")

TORCH_VERSION = '2.14.1'

#: torch.optim class name -> {argument: default}, in the signature's order
DEFAULTS = {
 'ASGD': {'lr': 0.01,
          'lambd': 0.0001,
          'alpha': 0.75,
          't0': 1000000.0,
          'weight_decay': 0,
          'foreach': None,
          'maximize': False,
          'differentiable': False,
          'capturable': False},
 'Adadelta': {'lr': 1.0,
              'rho': 0.9,
              'eps': 1e-06,
              'weight_decay': 0,
              'foreach': None,
              'capturable': False,
              'maximize': False,
              'differentiable': False},
 'Adafactor': {'lr': 0.01,
               'beta2_decay': -0.8,
               'eps': (None, 0.001),
               'd': 1.0,
               'weight_decay': 0.0,
               'foreach': None,
               'maximize': False},
 'Adagrad': {'lr': 0.01,
             'lr_decay': 0,
             'weight_decay': 0,
             'initial_accumulator_value': 0,
             'eps': 1e-10,
             'foreach': None,
             'maximize': False,
             'differentiable': False,
             'fused': None},
 'Adam': {'lr': 0.001,
          'betas': (0.9, 0.999),
          'eps': 1e-08,
          'weight_decay': 0,
          'amsgrad': False,
          'foreach': None,
          'maximize': False,
          'capturable': False,
          'differentiable': False,
          'fused': None,
          'decoupled_weight_decay': False},
 'AdamW': {'lr': 0.001,
           'betas': (0.9, 0.999),
           'eps': 1e-08,
           'weight_decay': 0.01,
           'amsgrad': False,
           'maximize': False,
           'foreach': None,
           'capturable': False,
           'differentiable': False,
           'fused': None},
 'Adamax': {'lr': 0.002,
            'betas': (0.9, 0.999),
            'eps': 1e-08,
            'weight_decay': 0,
            'foreach': None,
            'maximize': False,
            'differentiable': False,
            'capturable': False},
 'LBFGS': {'lr': 1,
           'max_iter': 20,
           'max_eval': None,
           'tolerance_grad': 1e-07,
           'tolerance_change': 1e-09,
           'history_size': 100,
           'line_search_fn': None,
           'maximize': False},
 'Muon': {'lr': 0.001,
          'weight_decay': 0.1,
          'momentum': 0.95,
          'nesterov': True,
          'ns_coefficients': (3.4445, -4.775, 2.0315),
          'eps': 1e-07,
          'ns_steps': 5,
          'adjust_lr_fn': None},
 'NAdam': {'lr': 0.002,
           'betas': (0.9, 0.999),
           'eps': 1e-08,
           'weight_decay': 0,
           'momentum_decay': 0.004,
           'decoupled_weight_decay': False,
           'foreach': None,
           'maximize': False,
           'capturable': False,
           'differentiable': False},
 'RAdam': {'lr': 0.001,
           'betas': (0.9, 0.999),
           'eps': 1e-08,
           'weight_decay': 0,
           'decoupled_weight_decay': False,
           'foreach': None,
           'maximize': False,
           'capturable': False,
           'differentiable': False},
 'RMSprop': {'lr': 0.01,
             'alpha': 0.99,
             'eps': 1e-08,
             'weight_decay': 0,
             'momentum': 0,
             'centered': False,
             'capturable': False,
             'foreach': None,
             'maximize': False,
             'differentiable': False},
 'Rprop': {'lr': 0.01,
           'etas': (0.5, 1.2),
           'step_sizes': (1e-06, 50),
           'capturable': False,
           'foreach': None,
           'maximize': False,
           'differentiable': False},
 'SGD': {'lr': 0.001,
         'momentum': 0,
         'dampening': 0,
         'weight_decay': 0,
         'nesterov': False,
         'maximize': False,
         'foreach': None,
         'differentiable': False,
         'fused': None},
 'SparseAdam': {'lr': 0.001, 'betas': (0.9, 0.999), 'eps': 1e-08, 'maximize': False}
}


def signature_defaults(optimizer_class) -> dict:
    """Every keyword argument of ``optimizer_class``'s constructor with its
    default (None where it has none), as its signature says."""
    out = {}
    for name, param in inspect.signature(optimizer_class).parameters.items():
        if name in ("self", "params") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        out[name] = None if param.default is param.empty else param.default
    return out


def installed_torch_version():
    """torch's version without importing it (its own where it is imported)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__.split("+")[0]
    from importlib import metadata
    try:
        return metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def known_defaults(torch_name):
    """The table's defaults of ``torch.optim.<torch_name>`` where they are
    this torch's, else None (then read the signature)."""
    if torch_name not in DEFAULTS or installed_torch_version() != TORCH_VERSION:
        return None
    return dict(DEFAULTS[torch_name])


def table_source() -> str:
    """This module's text with the table read from the installed torch."""
    import pprint

    import torch

    table = {name: signature_defaults(getattr(torch.optim, name)) for name in TORCH_OPTIMIZERS
             if hasattr(torch.optim, name)}
    with open(__file__) as f:
        text = f.read()
    head, rest = text.split("TORCH_VERSION = ", 1)
    tail = rest.split("\n}\n", 1)[1]
    body = pprint.pformat(table, width=110, sort_dicts=False)
    return (f"{head}TORCH_VERSION = {torch.__version__.split('+')[0]!r}\n\n"
            f"#: torch.optim class name -> {{argument: default}}, in the signature's order\n"
            f"DEFAULTS = {{\n {body[1:-1]}\n}}\n{tail}")


def rewrite():
    """This module, rewritten with the installed torch's table."""
    new = table_source()
    with open(__file__, "w") as f:
        f.write(new)
