"""The CPU quota a container's limit sets is read from cgroup files (v2 and v1) and caps torch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lopa.host.cpu_budget import cpu_quota, fit_torch_threads, usable_cpus


def cgroup_tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /sys/fs/cgroup (files relative to it) and /proc/self/cgroup (its text)."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    proc_file = tmp_path / "proc-cgroup"
    proc_file.write_text(proc)
    return root, proc_file


V2_ROOT = "0::/\n"
V1_ROOT = "12:pids:/\n4:cpu,cpuacct:/\n1:name=systemd:/\n"


@pytest.mark.parametrize(
    ("proc", "files", "cores"),
    [
        (V2_ROOT, {"cpu.max": "400000 100000"}, 4.0),
        (V2_ROOT, {"cpu.max": "150000 100000"}, 1.5),
        (V2_ROOT, {"cpu.max": "max 100000"}, None),
        # Not in a cgroup namespace: the process's own cgroup counts, not the root's.
        ("0::/kubepods/p1/c1\n", {"cpu.max": "max 100000", "kubepods/p1/c1/cpu.max": "200000 100000"}, 2.0),
        (V1_ROOT, {"cpu,cpuacct/cpu.cfs_quota_us": "300000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 3.0),
        (V1_ROOT, {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        (V2_ROOT, {}, None),  # no cgroup files at all (another OS, a locked-down sandbox)
        (V2_ROOT, {"cpu.max": "lots 100000"}, None),  # not understood: torch keeps its count
        (V2_ROOT, {"cpu.max": "100000 0"}, None),
    ],
)
def test_cpu_quota(tmp_path: Path, proc: str, files: dict[str, str], cores: float | None) -> None:
    root, proc_file = cgroup_tree(tmp_path, proc, files)
    assert cpu_quota(root, proc_file) == cores


def test_usable_cpus_rounds_the_quota_down_and_never_below_one(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    for quota, expected in (("50000 100000", 1), ("150000 100000", 1), ("max 100000", affinity)):
        root, proc_file = cgroup_tree(tmp_path / quota.split()[0], V2_ROOT, {"cpu.max": quota})
        assert usable_cpus(root, proc_file) == expected
    root, proc_file = cgroup_tree(tmp_path / "big", V2_ROOT, {"cpu.max": f"{(affinity + 8) * 100000} 100000"})
    assert usable_cpus(root, proc_file) == affinity  # a quota above the affinity mask does not add cores


@pytest.fixture
def torch_threads(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_fit_torch_threads_caps_torch_at_the_quota(tmp_path: Path, torch_threads) -> None:
    root, proc_file = cgroup_tree(tmp_path, V2_ROOT, {"cpu.max": "100000 100000"})
    assert fit_torch_threads(root, proc_file) == 1
    assert torch.get_num_threads() == 1


def test_fit_torch_threads_leaves_torch_alone_without_a_binding_quota(tmp_path: Path, torch_threads) -> None:
    root, proc_file = cgroup_tree(tmp_path, V2_ROOT, {"cpu.max": "max 100000"})
    assert fit_torch_threads(root, proc_file) is None
    assert torch.get_num_threads() == 2


def test_omp_num_threads_overrides_the_quota(tmp_path: Path, torch_threads, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    root, proc_file = cgroup_tree(tmp_path, V2_ROOT, {"cpu.max": "100000 100000"})
    assert fit_torch_threads(root, proc_file) is None
    assert torch.get_num_threads() == 2
