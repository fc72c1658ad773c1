"""The progress sink, re-exported where the search and the bring-up import it: it lives in `tuner/progress.py`,
below every tuner layer, so that the fabric model and the measurements can take one too."""

from moetune.tuner.progress import NoProgress, Progress

__all__ = ["NoProgress", "Progress"]
