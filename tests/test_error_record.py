"""The error record's first-error-wins rule (csrc/mt_common.h mt::write_record), in host simulation (tests/proxy_sim.py's
library): reporters failing at once must leave one whole error, never one error's code with another's peer, slot and
epoch. The record is claimed with a compare-and-swap on a claim word before any field is written; testing the code
word for 0 let two reporters both pass and interleave their fields."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_sim


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(proxy_sim.build(tmp_path_factory.mktemp("mtsim_record") / "libmtsim.so")))
    lib.mtsim_race_reports.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong]
    lib.mtsim_race_reports.restype = ctypes.c_longlong
    return lib


def test_reporters_failing_at_once_leave_one_whole_error(lib: ctypes.CDLL) -> None:
    """4 threads report 4 different errors into each of 256 records, 200 rounds (51,200 races; every fence yields the
    CPU, as a warp may stall between its stores). A check-then-write record leaves a few hundred of them mixed on a
    2-core box (100 to 600 a run); it is a race, so such a record could pass by chance, but not plausibly over this
    many."""
    assert lib.mtsim_race_reports(4, 256, 200) == 0
