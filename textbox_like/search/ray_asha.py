"""Tune's ASHA, leaving a mark for every trial it stops, so that a trial
stopped early is told apart from one stopped with its search (Ctrl+C), which
Tune records the same way (TERMINATED). Imported only with ray installed; a
module of its own because Tune pickles the scheduler with the experiment."""
from pathlib import Path

from ray.tune.schedulers import ASHAScheduler, TrialScheduler


def stop_mark(output, trial_id) -> Path:
    return Path(output) / "ray_trials" / f"{trial_id}.asha_stopped"


class MarkingASHA(ASHAScheduler):
    def __init__(self, output, **kwargs):
        super().__init__(**kwargs)
        self.output = str(output)

    def on_trial_result(self, tune_controller, trial, result):
        decision = super().on_trial_result(tune_controller, trial, result)
        if decision == TrialScheduler.STOP:
            mark = stop_mark(self.output, trial.trial_id)
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
        return decision
