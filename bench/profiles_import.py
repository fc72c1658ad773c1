"""Time `moetune profiles import` (tuner/store/io.py `import_bytes`, the write lock held throughout): a file into an
empty database, then the same file again (nothing new: every record found already stored).

    python bench/profiles_import.py [--records 4000] [--history 3000]

Cases, one line each: `many-keys` (records spread over distinct keys, one row a key) and `one-key` (records of one
key with other knobs: a long history, superseded rows). Prints `<case> import_s S reimport_s S`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import TOKEN_BUCKETS, ProfileKey, ProfileRecord
from moetune.tuner.store.store import Store


def key(i: int, one: bool) -> ProfileKey:
    return ProfileKey(fingerprint="f" * 16, software="s" * 16, transport_family="nvlink", ep_size=2, nodes=1,
                      hidden=7168 if one else 1024 + 64 * (i // len(TOKEN_BUCKETS)), intermediate=2048, experts=256,
                      topk=8, dtype="bfloat16", token_bucket=16 if one else TOKEN_BUCKETS[i % len(TOKEN_BUCKETS)])


def export(folder: Path, n: int, one: bool) -> bytes:
    with Store(folder / "src.db") as s:
        s.upsert_fingerprint("f" * 16, {"gpus": []}, origin="local")
        for i in range(n):
            s.put_profile(ProfileRecord(key=key(i, one), knobs=default_knobs("nvlink").replace(num_sms=1 + i % 128,
                                                                                               channels=1 + i // 128),
                                        latency_us=1000.0 - i * 0.1 if one else 10.0 + i, spread_us=0.01,
                                        backend="local:nccl", provenance="measured", measured_on="f" * 16))
        return s.dump_profiles()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=4000, help="many-keys: records (one key each)")
    ap.add_argument("--history", type=int, default=3000, help="one-key: records of the one key")
    a = ap.parse_args()
    for case, n, one in (("many-keys", a.records, False), ("one-key", a.history, True)):
        with tempfile.TemporaryDirectory() as tmp:
            data = export(Path(tmp), n, one)
            with Store(Path(tmp) / "dst.db") as d:
                t0 = time.perf_counter()
                first = d.import_bytes(data)
                t1 = time.perf_counter()
                again = d.import_bytes(data)
                t2 = time.perf_counter()
            assert first.inserted == n and again.skipped == n, (first, again)
        print(f"{case} import_s {t1 - t0:.3f} reimport_s {t2 - t1:.3f} records {n}", flush=True)


if __name__ == "__main__":
    main()
