"""Search algorithms: hyperopt's suggest functions driven one trial at a time
(ask/tell), so trials can run in parallel (TPE sees the running ones as
pending) and an interrupted search can rebuild the sampler's history from
``hyper_results.jsonl`` (no pickle)."""
from __future__ import annotations

import numpy as np

from textbox_like.core.errors import UserError, closest
from textbox_like.core.internals import hyperopt_trial_documents
from textbox_like.search.space import grid, sample

# name -> canonical algorithm
ALGO_NAMES = {
    "exhaustive": "exhaustive", "grid": "exhaustive",
    "random": "random", "rand": "random", "rand.suggest": "random", "hyperopt.rand.suggest": "random",
    "bayes": "tpe", "tpe": "tpe", "tpe.suggest": "tpe", "hyperopt.tpe.suggest": "tpe",
    "anneal": "anneal", "anneal.suggest": "anneal", "hyperopt.anneal.suggest": "anneal",
    "atpe": "atpe", "atpe.suggest": "atpe", "hyperopt.atpe.suggest": "atpe",
}
DEFAULT_EVALS = 10


def canonical_algo(name):
    algo = ALGO_NAMES.get(str(name).strip().lower())
    if algo is None:
        raise UserError(f"unknown --algo {name!r}{closest(name, ALGO_NAMES)}; choose from: exhaustive, random "
                        f"(rand), bayes (tpe), anneal, atpe, or hyperopt's dotted names like tpe.suggest")
    return algo


def suggest_fn(algo):
    if algo == "random":
        from hyperopt import rand
        return rand.suggest
    if algo == "tpe":
        from hyperopt import tpe
        return tpe.suggest
    if algo == "anneal":
        from hyperopt import anneal
        return anneal.suggest
    if algo == "atpe":
        try:
            import lightgbm  # noqa: F401
            import sklearn  # noqa: F401
            from hyperopt import atpe
        except ImportError as exc:
            raise UserError(f"--algo atpe needs lightgbm and scikit-learn ({exc.name or exc} is missing): "
                            f"pip install lightgbm scikit-learn, or use --algo tpe") from None
        return atpe.suggest
    raise ValueError(algo)


def trial_seed(seed, k):
    """The sampler's seed for trial k: fixed by (--seed, k), whatever ran before."""
    return int(np.random.default_rng([int(seed), int(k)]).integers(2 ** 31 - 1))


def plain_value(value):
    """A value hyperopt drew (a numpy scalar) as plain Python."""
    if hasattr(value, "item") and not isinstance(value, (list, dict, str, tuple)):
        return value.item()
    return value


class Sampler:
    """Proposes trial k's parameters; learns from finished trials."""

    def __init__(self, space, algo, seed):
        self.space, self.algo, self.seed = space, algo, int(seed)
        if algo == "exhaustive":
            self.points = grid(space)
            self.continuous = [n for n, p in space.items() if not p.finite]
            return
        from hyperopt import Trials
        from hyperopt.base import Domain
        self.suggest = suggest_fn(algo)
        self.hspace = {n: p.hyperopt() for n, p in space.items()}
        self.domain = Domain(lambda _: 0.0, self.hspace)
        self.trials = Trials()

    @property
    def grid_size(self):
        return len(self.points) if self.algo == "exhaustive" else None

    def ask(self, k):
        """(params, vals) for trial k (1-based). vals: hyperopt's own record of the draw."""
        if self.algo == "exhaustive":
            if k > len(self.points):
                raise IndexError(k)
            drawn = sample(self.space, self.continuous, np.random.default_rng([self.seed, k]))
            params = {n: (self.points[k - 1][n] if n in self.points[k - 1] else drawn[n]) for n in self.space}
            return params, {}
        from hyperopt import JOB_STATE_RUNNING
        self.trials.refresh()
        docs = self.suggest([k], self.domain, self.trials, trial_seed(self.seed, k))
        for doc in docs:
            doc["state"] = JOB_STATE_RUNNING
        self.trials.insert_trial_docs(docs)
        self.trials.refresh()
        vals = {label: [plain_value(v) for v in values] for label, values in docs[0]["misc"]["vals"].items()}
        return self.params_from_vals(vals), vals

    def params_from_vals(self, vals):
        from hyperopt import space_eval
        point = space_eval(self.hspace, {label: v[0] for label, v in vals.items() if v})
        return {n: self.space[n].clean(point[n]) for n in self.space}

    def tell(self, k, loss):
        """Trial k ended: loss (lower is better) or None when it failed."""
        if self.algo == "exhaustive":
            return
        from hyperopt import JOB_STATE_DONE, STATUS_FAIL, STATUS_OK
        for doc in hyperopt_trial_documents(self.trials):
            if doc["tid"] == k:
                doc["state"] = JOB_STATE_DONE
                doc["result"] = {"status": STATUS_OK, "loss": float(loss)} if loss is not None \
                    else {"status": STATUS_FAIL}
        self.trials.refresh()

    def replay(self, k, vals, loss, running=False):
        """Rebuild history from a record of hyper_results.jsonl (resume)."""
        if self.algo == "exhaustive":
            return
        from hyperopt import JOB_STATE_DONE, JOB_STATE_RUNNING, STATUS_FAIL, STATUS_OK
        idxs = {label: ([k] if v else []) for label, v in vals.items()}
        misc = {"tid": k, "cmd": self.domain.cmd, "workdir": None, "idxs": idxs, "vals": vals}
        result = {"status": "new"} if running else (
            {"status": STATUS_OK, "loss": float(loss)} if loss is not None else {"status": STATUS_FAIL})
        docs = self.trials.new_trial_docs([k], [None], [result], [misc])
        docs[0]["state"] = JOB_STATE_RUNNING if running else JOB_STATE_DONE
        self.trials.insert_trial_docs(docs)
        self.trials.refresh()
