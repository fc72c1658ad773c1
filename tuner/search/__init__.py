"""Search: the policy (what may be tuned), the space, the Optuna study (`study`) with its storage (`storage`), the
processes sharing it (`workers`), what its trials count as (`trials`) and reading studies back (`readback`), the
tuning driver that writes profiles (`tune`) and the measurement backends.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from moetune.runtime._lazy import lazy_getattr

_LAZY = {
    "BucketPrior": ".study",
    "FINISHED": ".trials",
    "OPTUNA_DB_NAME": ".storage",
    "PresetFacts": ".tune",
    "STUDY_PREFIX": ".study",
    "StudyResult": ".study",
    "TuneResult": ".tune",
    "WARM_LOCK_SUFFIX": ".study",
    "WORKER": ".workers",
    "completed": ".trials",
    "default_storage_url": ".storage",
    "describe_study": ".readback",
    "dumps": ".readback",
    "enqueue_warm_start": ".study",
    "facts_link_rates": ".tune",
    "fail_interrupted": ".workers",
    "family_names": ".tune",
    "finished_trials": ".trials",
    "is_sqlite": ".storage",
    "list_studies": ".readback",
    "log": ".study",
    "make_backend": ".tune",
    "make_sampler": ".study",
    "make_storage": ".storage",
    "neighbour_bucket": ".study",
    "normalize_url": ".storage",
    "open_study": ".study",
    "run_study": ".study",
    "sqlite_path": ".storage",
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
