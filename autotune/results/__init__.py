"""Results: what a study leaves behind.

Study files (best.json, trials.csv, study.json, serve_command.sh), MLflow tracking and
its sync, the best config per shape across studies (registry, warm starts), plots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.results._outputs import (
        TrialsCsvCallback,
        TuneResult,
        best_config,
        write_atomic,
        write_config,
        write_json_atomic,
        write_results,
    )
    from autotune.results._plots import (
        PLOT_FILES,
        param_importances,
        pareto_front,
        write_study_plots,
    )
    from autotune.results._registry import (
        PRIOR_ATTR,
        TunedStudy,
        WarmStart,
        explain_miss,
        find_best,
        tuned_studies,
    )
    from autotune.results._tracked import (
        find_best_tracked,
        tracked_inputs,
    )
    from autotune.results._tracking import (
        BEST_TAG,
        BEST_VALUE,
        EXPERIMENT_KIND,
        TAGS,
        MlflowCallback,
        MlflowTracker,
        default_tracking_uri,
    )
    from autotune.results._tracking import (
        _declared as _declared,
    )
    from autotune.results._tracking_sync import (
        sync_study,
    )
    from autotune.results._warm import (
        Learned,
        learn_from_store,
        plan_retune,
        warm_start_from,
    )

__all__ = [
    "BEST_TAG",
    "BEST_VALUE",
    "EXPERIMENT_KIND",
    "PLOT_FILES",
    "PRIOR_ATTR",
    "TAGS",
    "Learned",
    "MlflowCallback",
    "MlflowTracker",
    "TrialsCsvCallback",
    "TuneResult",
    "TunedStudy",
    "WarmStart",
    "best_config",
    "default_tracking_uri",
    "explain_miss",
    "find_best",
    "find_best_tracked",
    "learn_from_store",
    "param_importances",
    "pareto_front",
    "plan_retune",
    "sync_study",
    "tracked_inputs",
    "tuned_studies",
    "warm_start_from",
    "write_atomic",
    "write_config",
    "write_json_atomic",
    "write_results",
    "write_study_plots",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.results._outputs": (
        "TrialsCsvCallback",
        "TuneResult",
        "best_config",
        "write_atomic",
        "write_config",
        "write_json_atomic",
        "write_results",
    ),
    "autotune.results._plots": (
        "PLOT_FILES",
        "param_importances",
        "pareto_front",
        "write_study_plots",
    ),
    "autotune.results._registry": (
        "PRIOR_ATTR",
        "TunedStudy",
        "WarmStart",
        "explain_miss",
        "find_best",
        "tuned_studies",
    ),
    "autotune.results._tracked": ("find_best_tracked", "tracked_inputs"),
    "autotune.results._tracking": (
        "BEST_TAG",
        "BEST_VALUE",
        "EXPERIMENT_KIND",
        "MlflowCallback",
        "MlflowTracker",
        "TAGS",
        "_declared",
        "default_tracking_uri",
    ),
    "autotune.results._tracking_sync": ("sync_study",),
    "autotune.results._warm": ("Learned", "learn_from_store", "plan_retune",
                               "warm_start_from"),
})
