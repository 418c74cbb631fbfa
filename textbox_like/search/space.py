"""Space files: TextBox's text lines or a YAML mapping, with hyperopt's meaning.

TextBox format (one parameter per line; ``#`` comments and blank lines are
skipped; the space is read with ``ast.literal_eval``, never ``eval``)::

    learning_rate loguniform (-8, 0)
    max_sentences choice [32, 64]

YAML format (read with ``yaml.safe_load``)::

    lr: {loguniform: [-8, 0]}
    max_sentences: {choice: [32, 64]}

The two are told apart by content: a first line of the form ``name:`` or
``{`` is YAML. Every expression is built with hyperopt's own ``hp.*`` and means
exactly what it means in hyperopt (``loguniform(low, high)`` is
``exp(uniform(low, high))``).
"""
from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from textbox_like.config.files import read_text_file
from textbox_like.config.value_types import with_numbers
from textbox_like.core.errors import UserError, closest, first_line, nearest

# kind -> argument names (hyperopt's order)
KINDS = {
    "choice": ("options",),
    "pchoice": ("p_options",),
    "randint": ("low", "upper"),          # randint(upper) or randint(low, upper): integers in [low, upper)
    "uniform": ("low", "high"),
    "quniform": ("low", "high", "q"),
    "loguniform": ("low", "high"),
    "qloguniform": ("low", "high", "q"),
    "normal": ("mu", "sigma"),
    "qnormal": ("mu", "sigma", "q"),
    "lognormal": ("mu", "sigma"),
    "qlognormal": ("mu", "sigma", "q"),
    "uniformint": ("low", "high"),        # integers low .. high, both included
}
FINITE = ("choice", "pchoice", "randint", "uniformint", "quniform", "qloguniform")
MAX_GRID_VALUES = 100_000

from textbox_like.config.compat import TEXTBOX_ALIASES  # noqa: E402  TextBox's option names with a counterpart here


def _g(value):
    return f"{value:.3g}"


@dataclass
class Param:
    name: str                   # trainer option (its dest)
    kind: str
    args: list = field(default_factory=list)
    label: str = ""             # as written in the file
    where: str = ""             # "space file F line N"

    # ------------------------------------------------------------ hyperopt
    def hyperopt(self):
        """The hyperopt expression (hp.*), labelled with the option name."""
        from hyperopt import hp
        if self.kind == "choice":
            return hp.choice(self.name, list(self.args))
        if self.kind == "pchoice":
            return hp.pchoice(self.name, [tuple(pair) for pair in self.args])
        return getattr(hp, self.kind)(self.name, *self.args)

    @property
    def integer(self):
        """q-expressions whose numbers are all integers give integers, randint/uniformint always."""
        if self.kind in ("randint", "uniformint"):
            return True
        if self.kind in ("quniform", "qloguniform", "qnormal", "qlognormal"):
            return all(isinstance(v, int) for v in self.args)
        return False

    def clean(self, value):
        """A sampled value -> plain Python (numpy scalars, integral q-values)."""
        if hasattr(value, "item") and not isinstance(value, (list, dict, str, tuple)):
            value = value.item()
        if self.kind in ("choice", "pchoice"):
            return value
        if self.integer:
            return int(round(value))
        return float(value)

    # ------------------------------------------------------------ finite values
    @property
    def finite(self):
        return self.kind in FINITE

    def values(self):
        """Every value a finite parameter can take (with positive probability)."""
        if self.kind == "choice":
            return list(self.args)
        if self.kind == "pchoice":
            return [v for p, v in self.args if p > 0]
        if self.kind == "randint":
            low, upper = (0, self.args[0]) if len(self.args) == 1 else self.args
            return list(range(low, upper))
        if self.kind == "uniformint":
            low, high, q = self.args[0], self.args[1], 1
        elif self.kind == "quniform":
            low, high, q = self.args
        elif self.kind == "qloguniform":
            low, high, q = math.exp(self.args[0]), math.exp(self.args[1]), self.args[2]
        else:
            raise ValueError(f"{self.kind} has no finite set of values")
        # round(x / q) * q for x in [low, high] (hyperopt's rounding); ties have probability 0
        k_min = math.floor(low / q - 0.5) + 1
        k_max = math.ceil(high / q + 0.5) - 1
        if low == high:
            k_min = k_max = round(low / q)
        if k_max - k_min + 1 > MAX_GRID_VALUES:
            raise UserError(f"{self.where}: {self.label} takes {k_max - k_min + 1} values, too many for a grid")
        return [self.clean(k * q) for k in range(k_min, k_max + 1)]

    # ------------------------------------------------------------ display
    def expression(self):
        if self.kind in ("choice", "pchoice"):
            return f"{self.kind}({list(self.args)!r})"
        return f"{self.kind}({', '.join(repr(a) for a in self.args)})"

    def real_range(self):
        """The range in real units, e.g. '0.000335 .. 1'."""
        k, a = self.kind, self.args
        if k in ("choice", "pchoice"):
            vals = self.values() if k == "choice" else [f"{v!r} (p {p:g})" for p, v in a]
            return f"{len(a)} values: " + ", ".join(str(v) for v in vals)
        if k in ("randint", "uniformint", "quniform", "qloguniform"):
            vals = self.values()
            step = "integers" if k in ("randint", "uniformint") else f"multiples of {a[2]!r}"
            return f"{_g(vals[0])} .. {_g(vals[-1])} ({step}, {len(vals)} values)"
        if k == "uniform":
            return f"{_g(a[0])} .. {_g(a[1])}"
        if k == "loguniform":
            return f"{_g(math.exp(a[0]))} .. {_g(math.exp(a[1]))}"
        mu, s = a[0], a[1]
        lo, hi = mu - 1.96 * s, mu + 1.96 * s
        q = f", multiples of {a[2]!r}" if k.startswith("q") else ""
        if k in ("normal", "qnormal"):
            return f"mean {_g(mu)}, 95% within {_g(lo)} .. {_g(hi)}{q}"
        return f"median {_g(math.exp(mu))}, 95% within {_g(math.exp(lo))} .. {_g(math.exp(hi))}{q}"

    def describe(self):
        text = f"{self.label or self.name}: {self.expression()} = {self.real_range()}"
        if self.label and self.label.replace("-", "_") != self.name:
            text += f"  [--{self.name.replace('_', '-')}]"
        if self.kind in ("loguniform", "qloguniform") and 0 < self.args[0] < self.args[1] <= 1:
            text += ("  (note: the bounds are natural logs, as in hyperopt; for values "
                     f"{_g(self.args[0])} .. {_g(self.args[1])} write "
                     f"({math.log(self.args[0]):.3f}, {math.log(self.args[1]):.3f}))")
        return text


# ====================================================================== labels
def resolve_label(label, options, where):
    """A label -> the trainer option's dest: any spelling the trainer's parser
    knows (its aliases included), else TextBox's name for it. ``OPTION.KEY``
    names one key of a dict option (``model_conf.hidden_size``)."""
    for spelling in dict.fromkeys((label, label.replace("_", "-"), label.replace("-", "_"))):
        dest = options.dest_of("--" + spelling)
        if dest in options.actions:
            return dest
    dest = TEXTBOX_ALIASES.get(label.replace("-", "_"))
    if dest is not None and dest.split(".")[0] in options.actions:
        return dest
    option, dot, key = label.partition(".")
    if dot and key:
        dest = resolve_label(option, options, where)
        if not isinstance(options.actions[dest].default, dict):
            raise UserError(f"{where}: {label!r}: {option} is not a dict option, so it has no key {key!r}; "
                            f"OPTION.KEY labels are for model_conf, optim_conf and scheduler_conf")
        return f"{dest}.{key}"
    known = sorted({s[2:] for s in options.flags if s.startswith("--")} | set(TEXTBOX_ALIASES))
    near = nearest(label, known)     # always name the closest one
    hint = f" (the closest option is {near!r})" if near else ""
    raise UserError(f"{where}: {label!r} is not an option of run_hetseq.py{hint}; "
                    f"labels are trainer options (run_hetseq.py --help) or TextBox names "
                    f"({', '.join(sorted(TEXTBOX_ALIASES))})")


# ====================================================================== one parameter
def _num(value, where, what):
    value = with_numbers(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{where}: {what} must be a finite number, got {value!r}")
    return value


def make_param(label, kind, args, where, options=None):
    """Check one `label kind args` and build its Param."""
    label = str(label)
    if kind not in KINDS:
        raise UserError(f"{where}: unknown kind {kind!r}{closest(kind, KINDS)}; kinds: {', '.join(KINDS)}")
    name = resolve_label(label, options, where) if options is not None else label.replace("-", "_")
    if kind == "choice":
        if not isinstance(args, (list, tuple)) or not args:
            raise UserError(f"{where}: choice expects a non-empty list of values like [32, 64], got {args!r}")
        return Param(name, kind, list(args), label, where)
    if kind == "pchoice":
        if not isinstance(args, (list, tuple)) or not args or \
                not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in args):
            raise UserError(f"{where}: pchoice expects a list of (probability, value) pairs like "
                            f"[(0.8, 'adam'), (0.2, 'sgd')], got {args!r}")
        pairs = [[_num(p, where, "a probability"), v] for p, v in args]
        if any(p < 0 for p, _ in pairs) or abs(sum(p for p, _ in pairs) - 1) > 1e-6:
            raise UserError(f"{where}: pchoice probabilities must be >= 0 and sum to 1, got "
                            f"{[p for p, _ in pairs]}")
        return Param(name, kind, pairs, label, where)
    if not isinstance(args, (list, tuple)):
        args = [args]
    names = KINDS[kind]
    wanted = (1, 2) if kind == "randint" else (len(names),)
    if len(args) not in wanted:
        shape = "(upper) or (low, upper)" if kind == "randint" else f"({', '.join(names)})"
        raise UserError(f"{where}: {kind} expects {shape}, got {tuple(args)!r}")
    args = [_num(v, where, f"{kind}'s arguments") for v in args]
    if kind == "randint":
        if not all(isinstance(v, int) for v in args):
            raise UserError(f"{where}: randint expects integers, got {tuple(args)!r}")
        low, upper = (0, args[0]) if len(args) == 1 else args
        if upper <= low:
            raise UserError(f"{where}: randint needs low < upper (upper excluded), got {tuple(args)!r}")
    elif kind in ("normal", "qnormal", "lognormal", "qlognormal"):
        if args[1] <= 0:
            raise UserError(f"{where}: {kind} needs sigma > 0, got {tuple(args)!r}")
    elif args[1] < args[0]:
        raise UserError(f"{where}: {kind} needs low <= high, got {tuple(args)!r}")
    if kind.startswith("q") and args[2] <= 0:
        raise UserError(f"{where}: {kind} needs q > 0, got {tuple(args)!r}")
    param = Param(name, kind, list(args), label, where)
    if param.finite:
        values = param.values()
        if not values:
            raise UserError(f"{where}: {param.expression()} takes no value; widen the range")
    return param


# ====================================================================== files
_YAML_START = re.compile(r"^\s*(\{|[^\s#]+\s*:(\s|$))")


def detect_format(text):
    """'yaml' or 'textbox' by content."""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped == "---":
            continue
        return "yaml" if _YAML_START.match(line) else "textbox"
    return "empty"


def _literal(text, where):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    if "#" in text:            # a trailing comment
        try:
            return ast.literal_eval(text.split("#", 1)[0].strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    raise UserError(f"{where}: the space {text!r} is not a Python literal (a list like [32, 64] or a "
                    f"tuple like (-8, 0)); space files are read, never executed")


def parse_textbox(text, source, options=None):
    space = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source} line {number}"
        parts = stripped.split(None, 2)
        if len(parts) < 3:
            raise UserError(f"{where}: expected '<label> <algorithm> <space>', like "
                            f"'learning_rate loguniform (-8, 0)'; got {stripped!r}")
        label, kind, raw = parts
        if kind not in KINDS:
            raise UserError(f"{where}: unknown kind {kind!r}{closest(kind, KINDS)}; kinds: {', '.join(KINDS)}")
        _add(space, make_param(label, kind, _literal(raw, where), where, options))
    return space


def _yaml_lines(text):
    """Top-level key -> line number (1-based)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


def parse_yaml(text, source, options=None):
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source} line {mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or first_line(exc)
        raise UserError(f"{where}: not valid YAML: {problem}") from None
    if not isinstance(data, dict) or not data:
        raise UserError(f"{source}: expected 'option: {{kind: args}}' lines (YAML) or "
                        f"'<label> <algorithm> <space>' lines (TextBox); got {type(data).__name__}")
    lines = _yaml_lines(text)
    space = {}
    for label, spec in data.items():
        where = f"{source} line {lines.get(str(label), '?')}"
        q = None
        if isinstance(spec, dict) and len(spec) == 2 and "q" in spec:
            spec = dict(spec)
            q = spec.pop("q")
        if not isinstance(spec, dict) or len(spec) != 1:
            raise UserError(f"{where}: {label}: expected one {{kind: args}}, like {{choice: [32, 64]}} or "
                            f"{{loguniform: [-8, 0]}}; got {spec!r}")
        kind, args = next(iter(spec.items()))
        if kind not in KINDS:
            raise UserError(f"{where}: unknown kind {kind!r}{closest(kind, KINDS)}; kinds: {', '.join(KINDS)}")
        if q is not None:
            if not kind.startswith("q"):
                raise UserError(f"{where}: 'q' belongs to the q-kinds (quniform, qloguniform, qnormal, qlognormal)")
            args = list(args if isinstance(args, (list, tuple)) else [args]) + [q]
        if kind == "pchoice" and isinstance(args, dict):
            args = [(p, v) for v, p in args.items()]
        _add(space, make_param(label, kind, args, where, options))
    return space


def _add(space, param):
    if param.name in space:
        first = space[param.name]
        raise UserError(f"{param.where}: {param.label} sets --{param.name.replace('_', '-')} again "
                        f"(already set by {first.label}, {first.where.rsplit(' line ', 1)[-1].join(['line ', ''])})")
    space[param.name] = param


def load_space(path, options=None):
    """Read a space file (either format) -> {option dest: Param}, in file order."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"space file {str(path)!r} does not exist; check the path")
    # one line naming the file when it is empty, binary or not UTF-8
    text = read_text_file(path, "space file", "search-space")
    source = f"space file {path}"
    fmt = detect_format(text)
    if fmt == "empty":
        raise UserError(f"{source}: holds no parameter; write lines like 'learning_rate loguniform (-8, 0)'")
    return parse_yaml(text, source, options) if fmt == "yaml" else parse_textbox(text, source, options)


def parse_space(data, source="space file", options=None):
    """A mapping {label: {kind: args}} (already loaded) -> {dest: Param}."""
    return parse_yaml(yaml.safe_dump(data, sort_keys=False), source, options)


# ====================================================================== grids and samples
def grid(space):
    """Every combination of the finite parameters' values, in file order."""
    import itertools
    finite = [p for p in space.values() if p.finite]
    size = 1
    for p in finite:
        size *= len(p.values())
    if size > MAX_GRID_VALUES:
        raise UserError(f"the grid of the finite parameters has {size} points; too many for --algo exhaustive")
    names = [p.name for p in finite]
    return [dict(zip(names, combo)) for combo in itertools.product(*(p.values() for p in finite))]


def sample(space, names, rng):
    """Sample the parameters ``names`` with hyperopt's own sampler."""
    from hyperopt.pyll import stochastic
    if not names:
        return {}
    drawn = stochastic.sample({n: space[n].hyperopt() for n in names}, rng=rng)
    return {n: space[n].clean(drawn[n]) for n in names}
