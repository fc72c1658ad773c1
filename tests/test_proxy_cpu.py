"""Where the proxy thread runs (the runtime option `proxy_cpu`): the CPU list parser, the choice of the set of CPUs
local to the GPU's NUMA node (allowed CPUs, nothing usable), the option's validation, and the transport handing its
choice to the engine. The engine pinning itself is checked in host simulation in
tests/test_onesided_cpu.py; on a GPU at the end of this file."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

from moetune.runtime import _once
from moetune.runtime.config import ConfigError
from moetune.runtime.options import (
    MAX_CPU_INDEX,
    PROCESS_LOCAL_OPTIONS,
    RuntimeOptionError,
    RuntimeOptions,
    parse_cpulist,
    proxy_cpu_setting,
    settings_markdown,
)
from moetune.runtime.transports import _affinity
from moetune.runtime.transports._affinity import (
    CpuChoice,
    format_cpulist,
    resolve,
    sysfs_pci_address,
    usable_cpus,
)

ROOT = Path(__file__).resolve().parents[1]


# -- the CPU list syntax ------------------------------------------------------------------------------------------
def test_cpulist_parses_ranges_and_single_cpus() -> None:
    assert parse_cpulist("0-3,8-11") == (0, 1, 2, 3, 8, 9, 10, 11)
    assert parse_cpulist("5") == (5,)
    assert parse_cpulist("0-1,1,3\n") == (0, 1, 3)  # as sysfs writes it (a newline), each CPU once
    assert parse_cpulist(" 12 , 8-9 ") == (8, 9, 12)
    assert parse_cpulist("") == () and parse_cpulist("\n") == ()


@pytest.mark.parametrize("text", ["0-", "-1", "a", "1,,2", "1,", "3-1", "1-2-3", "0x3", "1 2", "1.5"])
def test_a_malformed_cpulist_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match=r"CPU list") as e:
        parse_cpulist(text)
    assert repr(text) in str(e.value)  # names what it was given


def test_a_cpu_index_past_the_engines_limit_is_refused() -> None:
    assert parse_cpulist(str(MAX_CPU_INDEX)) == (MAX_CPU_INDEX,)
    with pytest.raises(ValueError, match=f"CPU {MAX_CPU_INDEX + 1} is past"):
        parse_cpulist(f"0-{MAX_CPU_INDEX + 1}")


def test_the_cpu_limit_is_the_engines() -> None:
    header = (ROOT / "csrc" / "proxy_engine.h").read_text()
    assert f"#define MT_PROXY_MAX_CPU {MAX_CPU_INDEX + 1}" in header


def test_cpulist_formats_back() -> None:
    assert format_cpulist([11, 0, 1, 2, 3, 8, 9, 10]) == "0-3,8-11"
    assert format_cpulist([4]) == "4" and format_cpulist([]) == ""
    assert parse_cpulist(format_cpulist([1, 3, 4, 5, 9])) == (1, 3, 4, 5, 9)


def test_pci_addresses_are_named_as_sysfs_names_them() -> None:
    assert sysfs_pci_address("00000000:19:00.0") == "0000:19:00.0"
    assert sysfs_pci_address("0000:C1:00.0") == "0000:c1:00.0"
    assert sysfs_pci_address("10000:01:00.0") == "10000:01:00.0"
    assert sysfs_pci_address("GPU-1234") == ""


# -- choosing the set -------------------------------------------------------------------------------------------
def test_the_choice_is_the_local_cpus_the_process_may_use() -> None:
    c = usable_cpus(range(0, 8), allowed={4, 5, 6, 7, 20})
    assert c.cpus == (4, 5, 6, 7) and "CPUs 4-7" in c.reason
    assert not hasattr(c, "cpu")  # the set is the one form (the single-CPU `.cpu` view is gone)


def test_every_caller_gets_the_same_whole_set() -> None:
    """No per-rank or per-engine single CPU any more: every engine of a process (one per MoE layer) and every rank
    of a NUMA node get the whole set, and the OS places their threads within it."""
    cands = [8, 9, 10, 11]
    picks = {usable_cpus(cands, cands) for _ in range(4)}
    assert picks == {usable_cpus(cands, range(64))} and next(iter(picks)).cpus == (8, 9, 10, 11)


def test_no_allowed_local_cpu_means_unpinned_with_the_reason() -> None:
    c = usable_cpus([0, 1, 2, 3], allowed={8, 9}, what="the NUMA-local CPUs of GPU x")
    assert c.cpus == ()
    assert "none of the NUMA-local CPUs of GPU x (0-3) is allowed" in c.reason and "allowed: 8-9" in c.reason


def _fake_sysfs(root: Path, gpus: dict[str, str], others: tuple[str, ...] = ("0000:00:1f.0",)) -> Path:
    """A /sys/bus/pci/devices with NVIDIA GPUs (address -> local_cpulist) and a non-GPU device."""
    for addr, cpus in gpus.items():
        d = root / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        (d / "local_cpulist").write_text(cpus + "\n")
        (d / "numa_node").write_text("0\n")
    for addr in others:
        d = root / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x8086\n")
        (d / "class").write_text("0x060100\n")
        (d / "local_cpulist").write_text("0-15\n")
    return root


def test_numa_pins_to_the_local_set_of_the_gpu(tmp_path: Path) -> None:
    root = _fake_sysfs(tmp_path / "pci", {"0000:19:00.0": "0-7", "0000:3b:00.0": "0-7", "0000:9a:00.0": "8-15"})
    allowed = set(range(16))
    a = resolve("numa", address="0000:19:00.0", allowed=allowed, root=root)
    b = resolve("numa", address="0000:3b:00.0", allowed=allowed, root=root)
    c = resolve("numa", address="0000:9a:00.0", allowed=allowed, root=root)
    assert a.cpus == b.cpus == tuple(range(8))  # GPUs of one NUMA node: the same set, the OS spreads the threads
    assert c.cpus == tuple(range(8, 16))
    assert "NUMA-local CPUs of GPU 0000:9a:00.0" in c.reason
    # the process's allowed CPUs (a cgroup, taskset) are respected
    assert resolve("numa", address="0000:19:00.0", allowed={6, 7, 12}, root=root).cpus == (6, 7)


def test_numa_without_numa_information_is_unpinned_not_an_error(tmp_path: Path) -> None:
    root = _fake_sysfs(tmp_path / "pci", {"0000:19:00.0": ""})
    for address, why in (("0000:19:00.0", "lists no CPU"), ("0000:aa:00.0", "no NUMA information"),
                         ("", "no PCI address")):
        c = resolve("numa", address=address, allowed={0, 1}, root=root)
        assert c.cpus == () and why in c.reason
    c = resolve("numa", address="0000:19:00.0", allowed={0}, root=tmp_path / "no-sysfs")
    assert c.cpus == () and "no NUMA information" in c.reason
    (root / "0000:19:00.0" / "local_cpulist").write_text("garbage\n")
    c = resolve("numa", address="0000:19:00.0", allowed={0}, root=root)
    assert c.cpus == () and "no usable NUMA information" in c.reason


@pytest.mark.parametrize("numa_node", ["-1", None])
def test_a_gpu_without_a_numa_node_is_no_numa_information(tmp_path: Path, numa_node: str | None) -> None:
    """numa_node -1 (VMs, firmware without proximity information) comes with local_cpulist listing EVERY CPU;
    that, or no numa_node file, is no NUMA information: no pinning, with the reason, not "NUMA-local"."""
    root = _fake_sysfs(tmp_path / "pci", {"0000:19:00.0": "0-15"})
    node = root / "0000:19:00.0" / "numa_node"
    if numa_node is None:
        node.unlink()
    else:
        node.write_text(numa_node + "\n")
    c = resolve("numa", address="0000:19:00.0", allowed=set(range(16)), root=root)
    assert c.cpus == () and "no NUMA information" in c.reason, c
    assert ("numa_node -1" if numa_node else "numa_node") in c.reason
    assert _affinity.gpu_local_cpus("0000:19:00.0", root)[0] == ()
    node.write_text("1\n")  # a real node: its CPUs
    assert resolve("numa", address="0000:19:00.0", allowed=set(range(16)), root=root).cpus == tuple(range(16))


def test_none_and_explicit_settings(tmp_path: Path) -> None:
    root = _fake_sysfs(tmp_path / "pci", {"0000:19:00.0": "0-7"})
    assert resolve("none", address="0000:19:00.0", root=root).cpus == ()
    assert resolve("5", address="0000:19:00.0", allowed={5, 6}, root=root).cpus == (5,)
    assert resolve("12-15", address="", allowed=range(64)).cpus == (12, 13, 14, 15)
    assert resolve("12-15,40", address="", allowed=range(14)).cpus == (12, 13)  # the listed CPUs allowed
    c = resolve("12", address="", allowed={0, 1})
    assert c.cpus == () and "none of the CPUs of proxy_cpu='12' (12) is allowed" in c.reason


def test_the_docs_say_the_fifo_pages_follow_the_pinned_set() -> None:
    """mt_proxy_create places the FIFO and control pages on the set's NUMA node (place_pages) before it falls back
    to cudaHostAlloc, and before the thread exists: the docs must say so, and not that pinning places the
    thread only (tests/test_proxy_numa.py checks the placement itself)."""
    engine = (ROOT / "csrc" / "proxy_engine.cpp").read_text()
    create = engine[engine.index("MT_API int mt_proxy_create("):]
    assert create.index("e->place_pages(ring)") < create.index("cudaHostAlloc((void**)&e->fifo_host")
    assert create.index("cudaHostAlloc((void**)&e->fifo_host") < create.index("e->th = std::thread")
    for text in (_affinity.__doc__ or "", (ROOT / "csrc" / "README.md").read_text()):
        flat = " ".join(text.split())
        assert "mbind" in flat and "creating thread's NUMA node" in flat  # placed, or the fallback
        assert "Pinning places the thread only" not in flat and "does not place the request FIFO" not in flat


# -- the option ---------------------------------------------------------------------------------------------------
def test_proxy_cpu_is_an_option_with_numa_by_default(tmp_path: Path) -> None:
    assert RuntimeOptions().proxy_cpu == "numa"
    for value in ("numa", "none", "0", "12", "8-15,40"):
        assert RuntimeOptions(proxy_cpu=value).proxy_cpu == value
    assert RuntimeOptions.from_env({"MOETUNE_PROXY_CPU": " None "}).proxy_cpu == "none"
    assert RuntimeOptions.from_env({"MOETUNE_PROXY_CPU": "3"}).proxy_cpu == "3"
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    cfg = tmp_path / "moetune.toml"
    cfg.write_text('[runtime]\nproxy_cpu = "none"\n')
    assert RuntimeOptions.resolve(env={**env, "MOETUNE_CONFIG": str(cfg)}).proxy_cpu == "none"


@pytest.mark.parametrize("value", ["NUMA", " numa ", "Numa\n", "NONE", " None ", " 8-15, 40 "])
def test_proxy_cpu_case_and_white_space_are_the_same_from_every_source(value: str, tmp_path: Path) -> None:
    """One parser (proxy_cpu_setting) normalises the value whether it comes from the arguments, the config or the
    variable: `NUMA` is `numa` everywhere (the variable was lower-cased, the others refused it)."""
    want = value.strip().lower()
    kind, cpus = proxy_cpu_setting(value)
    assert kind == (want if want in ("numa", "none") else "cpus")
    assert cpus == ((8, 9, 10, 11, 12, 13, 14, 15, 40) if kind == "cpus" else ())
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    cfg = tmp_path / "moetune.toml"
    cfg.write_text(f"[runtime]\nproxy_cpu = {json.dumps(value)}\n")  # a TOML basic string
    got = [RuntimeOptions(proxy_cpu=value), RuntimeOptions.resolve({"proxy_cpu": value}, env=env),
           RuntimeOptions.from_env({"MOETUNE_PROXY_CPU": value}),
           RuntimeOptions.resolve(env={**env, "MOETUNE_CONFIG": str(cfg)})]
    assert {o.proxy_cpu for o in got} == {want}, [o.proxy_cpu for o in got]
    assert resolve(value, address="", allowed=range(64)).reason == resolve(want, address="", allowed=range(64)).reason


def test_proxy_cpu_is_left_out_of_the_digest_the_ranks_compare() -> None:
    """It places a thread of one process: ranks with different values (MOETUNE_PROXY_CPU per local rank, CPU
    lists of nodes laid out differently) must still agree; every other option still counts."""
    assert "proxy_cpu" in PROCESS_LOCAL_OPTIONS
    digests = {RuntimeOptions(proxy_cpu=v).digest() for v in ("numa", "none", "0", "8-15,40")}
    assert len(digests) == 1
    assert RuntimeOptions(proxy_cpu="3").digest() != RuntimeOptions(proxy_cpu="3", proxy_batch=2).digest()
    assert set(PROCESS_LOCAL_OPTIONS) <= set(RuntimeOptions.__struct_fields__)
    assert "proxy_cpu" in settings_markdown().split("compares their digests", 1)[1].split("\n\n", 1)[0]


@pytest.mark.parametrize("value", ["numa-ish", "", "3-1", "1,,2", "cpu5", 5, True, None, f"{MAX_CPU_INDEX + 1}"])
def test_a_bad_proxy_cpu_names_the_option_and_the_value(value: object) -> None:
    with pytest.raises(RuntimeOptionError, match=r"proxy_cpu \(MOETUNE_PROXY_CPU\)") as e:
        RuntimeOptions(proxy_cpu=value)
    assert repr(value) in str(e.value) and "numa" in str(e.value)


def test_a_bad_proxy_cpu_from_a_variable_or_the_config_says_where(tmp_path: Path) -> None:
    with pytest.raises(RuntimeOptionError, match=r"proxy_cpu.*'nearby'"):
        RuntimeOptions.from_env({"MOETUNE_PROXY_CPU": "nearby"})
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    cfg = tmp_path / "moetune.toml"
    cfg.write_text('[runtime]\nproxy_cpu = "far"\n')
    with pytest.raises(RuntimeOptionError, match=rf"runtime\.proxy_cpu in .*{cfg.name}: 'far'"):
        RuntimeOptions.resolve(env={**env, "MOETUNE_CONFIG": str(cfg)})
    cfg.write_text("[runtime]\nproxy_cpu = 12\n")  # TOML: a string, as every CPU list
    with pytest.raises(ConfigError, match=r"runtime\.proxy_cpu.*expected a string"):
        RuntimeOptions.resolve(env={**env, "MOETUNE_CONFIG": str(cfg)})


# -- the transport's choice ---------------------------------------------------------------------------------------
def test_missing_numa_information_under_numa_is_logged_not_warned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The default asks for nothing the user chose: a machine without sysfs PCI information (or a numa_node of -1)
    is noted once at info level (logging), never a warning, so a suite run with -W error still builds the
    transport."""
    import logging

    from moetune.runtime.transports import proxy as P

    monkeypatch.setattr(_affinity, "SYSFS_PCI", str(tmp_path / "no-sysfs"))
    _once.reset()
    monkeypatch.setattr(P, "gpu_pci_address", lambda device: "0000:19:00.0")
    dev = torch.device("cuda", 0)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="moetune.proxy"):
        warnings.simplefilter("error")
        assert P.proxy_cpu_choice(RuntimeOptions(), dev).cpus == ()
        assert P.proxy_cpu_choice(RuntimeOptions(proxy_cpu="NUMA"), dev).cpus == ()  # once
        assert P.proxy_cpu_choice(RuntimeOptions(proxy_cpu="none"), dev).cpus == ()  # asked for nothing: silent
    noted = [r for r in caplog.records if r.name == "moetune.proxy"]
    assert len(noted) == 1 and noted[0].levelno == logging.INFO
    assert "runs unpinned: no NUMA information" in noted[0].getMessage()
    _fake_sysfs(tmp_path / "pci", {"0000:19:00.0": format_cpulist(os.sched_getaffinity(0))})
    monkeypatch.setattr(_affinity, "SYSFS_PCI", str(tmp_path / "pci"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = P.proxy_cpu_choice(RuntimeOptions(), dev)
    assert c.cpus == tuple(sorted(os.sched_getaffinity(0)))


def test_numa_local_cpus_the_process_may_not_use_are_warned_under_the_default(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """The GPU's NUMA-local CPUs are known but the rank is bound elsewhere (the far socket): the misplacement the
    option exists for is a warning even under the default `numa` (missing NUMA information stays an info line)."""
    from moetune.runtime.transports import proxy as P

    _once.reset()
    far = max(os.sched_getaffinity(0)) + 1
    _fake_sysfs(tmp_path / "pci", {"0000:19:00.0": format_cpulist([far, far + 1])})
    monkeypatch.setattr(_affinity, "SYSFS_PCI", str(tmp_path / "pci"))
    monkeypatch.setattr(P, "gpu_pci_address", lambda device: "0000:19:00.0")
    with pytest.warns(_affinity.ProxyCpuWarning, match="runs unpinned: none of the NUMA-local CPUs"):
        assert P.proxy_cpu_choice(RuntimeOptions(), torch.device("cuda", 0)).cpus == ()


def test_an_explicit_cpu_list_that_cannot_be_applied_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.transports import proxy as P

    _once.reset()
    monkeypatch.setattr(P, "gpu_pci_address", lambda device: "")
    dev = torch.device("cuda", 0)
    outside = format_cpulist([max(os.sched_getaffinity(0)) + 1])
    with pytest.warns(_affinity.ProxyCpuWarning, match=rf"runs unpinned: none of the CPUs of proxy_cpu='{outside}'"):
        assert P.proxy_cpu_choice(RuntimeOptions(proxy_cpu=outside), dev).cpus == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert P.proxy_cpu_choice(RuntimeOptions(proxy_cpu=outside), dev).cpus == ()  # once


def test_the_engine_takes_only_a_set_of_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """One CPU is the set of one: a lone int (the old single-CPU form) or None is refused, before the library is
    loaded, instead of being read as a second form of the argument."""
    from moetune.runtime import csrc_build
    from moetune.runtime.transports import proxy as P

    def no_library(**kw: object) -> None:
        raise AssertionError("the argument is checked before the library is loaded")

    monkeypatch.setattr(csrc_build, "load", no_library)
    for bad in (3, None, "0-3", 3.0):
        with pytest.raises(TypeError, match="cpu must be a set of CPU indices"):
            P.ProxyEngine(0, [0], [0], [0], cpu=bad)  # type: ignore[arg-type]
    assert P.cpu_set([7, 3, 3]) == (3, 7) and P.cpu_set(()) == () and P.cpu_set(iter({5})) == (5,)


def test_the_transport_hands_its_choice_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """ProxyTransport with the library and the symmetric buffers faked (as tests/test_transport_lifecycle.py):
    the CPU set chosen under the option reaches mt_proxy_create, and proxy_cpu() reports the engine's answer."""
    import ctypes

    import torch.distributed as dist

    from moetune.runtime import csrc_build
    from moetune.runtime.knobs import default_knobs
    from moetune.runtime.transports import _onesided
    from moetune.runtime.transports import proxy as P

    created: list[list[int]] = []

    class Lib:
        def mt_ctrl_bytes(self, out: object) -> int:
            out._obj.value = 4096  # type: ignore[attr-defined]
            return 0

        def mt_enable_peer_access(self, dev: int, other: int) -> int:
            return 0

        def mt_proxy_create(self, *args: object) -> int:
            cpus, n = args[-4], args[-3]  # the CPU set and its size, before timeout_s and the out pointer
            created.append(list(cpus[:n]))  # type: ignore[index]
            args[-1]._obj.value = 0x5001  # type: ignore[attr-defined]
            return 0

        def mt_proxy_cpu(self, h: object, out: ctypes.Array, n: int) -> int:
            out[:5] = [len(created[-1]), 2, 0, created[-1][0], 4242]  # pinned there
            return 0

        def mt_proxy_cpu_list(self, h: object, out: ctypes.Array, n: int) -> int:
            out[:n] = created[-1][:n]
            return 0

        def mt_pxy_create(self, *args: object) -> int:
            args[-1]._obj.value = 0x6001  # type: ignore[attr-defined]
            return 0

        def __getattr__(self, name: str) -> object:
            return lambda *a: 0

    class Symm:
        def __init__(self, nbytes: int) -> None:
            self.peer_ptrs, self.local, self.backend = [0x100000], torch.zeros(nbytes, dtype=torch.uint8), "fake"

        def close(self) -> None:
            pass

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(csrc_build, "load", lambda **kw: Lib())
    monkeypatch.setattr(_onesided, "SymmBuffer", lambda nbytes, group, device, lib, mode="torch", timeout_s=20.0: Symm(nbytes))
    monkeypatch.setattr(_onesided, "_all_gather_ints", lambda values, group, device: [list(values)])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(_onesided.OneSidedTransport, "_current_stream_done", lambda self, timeout_s: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(P, "proxy_cpu_choice", lambda options, device: CpuChoice(
        () if options.proxy_cpu == "none" else (3, 5), f"test choice for {options.proxy_cpu}"))
    monkeypatch.setattr(P, "thread_affinity", lambda tid: (3, 5) if tid == 4242 else None)

    t = P.ProxyTransport(None, default_knobs("proxy"), torch.device("cuda", 0), options=RuntimeOptions())
    try:
        assert created == [[3, 5]]
        b = t.proxy_cpu()
        assert (b.requested, b.state, b.current, b.tid, b.error, b.allowed) == ((3, 5), "pinned", 3, 4242, "", (3, 5))
        assert b.reason == "test choice for numa"
    finally:
        t.close()
    t = P.ProxyTransport(None, default_knobs("proxy"), torch.device("cuda", 0),
                         options=RuntimeOptions(proxy_cpu="none"))
    t.close()
    assert created == [[3, 5], []]  # no pinning asked: no CPU


# -- on a GPU -----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the proxy engine on a real device)")
def test_the_proxy_threads_run_on_the_numa_local_cpus_of_their_gpu() -> None:
    from moetune.runtime.transports import proxy as P

    try:
        P.csrc_build.load()
    except P.csrc_build.BuildError as e:
        pytest.skip(f"the csrc library is not available: {e}")
    dev = torch.device("cuda", 0)
    address = P.gpu_pci_address(dev)
    assert re.fullmatch(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.0", address), address
    local, why = _affinity.gpu_local_cpus(address)
    choice = P.proxy_cpu_choice(RuntimeOptions(), dev)
    usable = tuple(sorted(set(local) & os.sched_getaffinity(0)))
    if not usable:
        assert choice.cpus == (), choice
        pytest.skip(f"no NUMA-local CPU usable here: {why or choice.reason}")
    assert choice.cpus == usable
    buf = torch.zeros(1 << 16, dtype=torch.uint8, device=dev)
    flags = torch.zeros(1024, dtype=torch.int64, device=dev)
    engines = [P.ProxyEngine(0, [buf.data_ptr()], [buf.data_ptr()], [flags.data_ptr()], cpu=choice.cpus)
               for _ in range(3)]  # as three MoE layers' buffers: each gets the whole set
    try:
        for eng in engines:
            b = eng.cpu_binding()
            assert (b.requested, b.state, b.allowed) == (usable, "pinned", usable), b
            assert b.current in usable, b
            status = Path(f"/proc/self/task/{b.tid}/status").read_text()
            assert re.search(rf"^Cpus_allowed_list:\s*{format_cpulist(usable)}$", status, re.M), status
    finally:
        for eng in engines:
            eng.close()
