"""Search: the policy (what may be tuned), the space, the Optuna study (`study`), the tuning driver that
writes profiles (`tune`) and the measurement backends.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from moetune.runtime._lazy import lazy_getattr

_LAZY = {
    "BucketPrior": ".study",
    "FINISHED": ".study",
    "OPTUNA_DB_NAME": ".study",
    "PresetFacts": ".tune",
    "STUDY_PREFIX": ".study",
    "StudyResult": ".study",
    "TuneResult": ".tune",
    "WARM_LOCK_SUFFIX": ".study",
    "WORKER": ".study",
    "completed": ".study",
    "default_storage_url": ".study",
    "describe_study": ".study",
    "dumps": ".study",
    "enqueue_warm_start": ".study",
    "facts_link_rates": ".tune",
    "fail_interrupted": ".study",
    "family_names": ".tune",
    "finished_trials": ".study",
    "is_sqlite": ".study",
    "list_studies": ".study",
    "log": ".study",
    "make_backend": ".tune",
    "make_sampler": ".study",
    "make_storage": ".study",
    "neighbour_bucket": ".study",
    "normalize_url": ".study",
    "open_study": ".study",
    "run_study": ".study",
    "sqlite_path": ".study",
    "study_config": ".study",
    "study_name": ".study",
    "summarize_study": ".study",
    "tune_profiles": ".tune",
    "tune_profiles_detailed": ".tune",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "FINISHED",
    "OPTUNA_DB_NAME",
    "STUDY_PREFIX",
    "WARM_LOCK_SUFFIX",
    "WORKER",
    "BucketPrior",
    "PresetFacts",
    "StudyResult",
    "TuneResult",
    "completed",
    "default_storage_url",
    "describe_study",
    "dumps",
    "enqueue_warm_start",
    "facts_link_rates",
    "fail_interrupted",
    "family_names",
    "finished_trials",
    "is_sqlite",
    "list_studies",
    "log",
    "make_backend",
    "make_sampler",
    "make_storage",
    "neighbour_bucket",
    "normalize_url",
    "open_study",
    "run_study",
    "sqlite_path",
    "study_config",
    "study_name",
    "summarize_study",
    "tune_profiles",
    "tune_profiles_detailed",
]
