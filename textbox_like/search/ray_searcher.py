"""Tune's HyperOptSearch, with every suggestion resolved into its trial's
configuration in the driver, where it is drawn (``prepare``: ray_backend's
TrialPreparer), so that the trial runs a resolved configuration, as the
local backend's trials do. Imported only with ray installed; a module of its
own because Tune pickles the searcher with the experiment."""
from ray.tune.search.hyperopt import HyperOptSearch


class ResolvingHyperOptSearch(HyperOptSearch):
    def __init__(self, prepare, **kwargs):
        super().__init__(**kwargs)
        self.prepare = prepare

    def suggest(self, trial_id):
        config = super().suggest(trial_id)
        if not isinstance(config, dict):          # None (wait) or FINISHED
            return config
        return {**config, **self.prepare(trial_id, config)}
