"""The host description every benchmark writes beside its results."""

import builtins
import os
import platform

from benchmarks import host


def test_names_this_processor_and_the_cores_this_process_may_use():
    described = host.describe()
    assert set(described) == {"machine", "cpu", "cores"}
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith("model name")]
        assert described["cpu"] in {line.split(":", 1)[1].strip() for line in lines}
    assert described["cpu"]
    assert 1 <= described["cores"] <= os.cpu_count()


def test_without_proc_cpuinfo_it_falls_back_on_what_python_knows(monkeypatch):
    def unreadable(path, *args, **kwargs):
        raise OSError(f"no {path}")

    monkeypatch.setattr(builtins, "open", unreadable)
    assert host.cpu_model() == (platform.processor() or platform.machine())
