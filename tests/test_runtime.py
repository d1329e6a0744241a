"""The allocator setting: large freed CPU buffers are reused, not page-faulted in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from difftrain import runtime

CHILD = r"""
import json, resource, sys
from difftrain.runtime import tune_allocator
state = tune_allocator()
import torch
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 1024 * 1024)  # 64 MiB: above glibc's largest default mmap threshold
    y = x * 2
    del x, y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"state": state, "faults": faults}))
"""


def _child(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    runtime.glibc_mallopt() is None, reason="needs glibc's mallopt (Linux with glibc; not macOS or musl)"
)
def test_tuned_allocator_reuses_large_blocks():
    tuned = _child({})
    assert tuned["state"] == "tuned"
    # two 64 MiB tensors are 32,768 pages; once the heap has grown to hold them (a few rounds)
    # they come back without faults (an occasional round still maps one of them again)
    assert sum(tuned["faults"][-8:]) < 40_000, tuned
    assert sorted(tuned["faults"][-8:])[4] < 1000, tuned  # most rounds fault nothing

    default = _child({"DIFFTRAIN_MALLOC": "default"})
    assert default["state"] == "off"
    assert min(default["faults"][-8:]) > 16_000, default  # each round maps (and faults) them again


def test_an_unknown_malloc_setting_is_refused_and_the_known_ones_read(monkeypatch):
    from difftrain.cli.app import main
    from difftrain.errors import ConfigError

    for value, want in (
        ("default", "off"),
        ("OFF", "off"),
        ("0", "off"),
        ("", "on"),
        ("on", "on"),
        ("1", "on"),
    ):
        monkeypatch.setenv("DIFFTRAIN_MALLOC", value)
        assert runtime.malloc_setting() == want, value
    monkeypatch.setenv("DIFFTRAIN_MALLOC", "glibc")
    with pytest.raises(ConfigError, match=r"DIFFTRAIN_MALLOC='glibc' is not a setting; set it to default"):
        runtime.malloc_setting()
    monkeypatch.delitem(runtime._state, "allocator", raising=False)
    assert main(["recipes", "list"]) == 2  # every command: one line, before any work


def test_user_settings_win():
    assert _child({"MALLOC_MMAP_THRESHOLD_": "131072"})["state"] in ("user",)


def test_the_bitsandbytes_kernels_hint_is_dropped_and_its_other_warnings_are_kept(caplog):
    import logging

    from difftrain.runtime import quiet_bitsandbytes_hint

    quiet_bitsandbytes_hint()
    quiet_bitsandbytes_hint()  # idempotent: one filter
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert len(log.filters) == 1
    with caplog.at_level(logging.WARNING, logger=log.name):
        log.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. pip install kernels", "x"
        )
        log.warning("something else went wrong")
    assert [r.getMessage() for r in caplog.records] == ["something else went wrong"]


def test_a_bitsandbytes_that_cannot_load_is_one_message_naming_what_needs_it_and_the_way_around(
    monkeypatch,
):
    import torch

    from difftrain.errors import DeviceError
    from difftrain.model.lora import import_bitsandbytes
    from difftrain.recipe import OptimConfig
    from difftrain.train.optim import build_optimizer

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    monkeypatch.delitem(sys.modules, "bitsandbytes.optim", raising=False)
    with pytest.raises(DeviceError) as e:
        build_optimizer(torch.nn.Linear(4, 4), OptimConfig(name="adamw8bit"), "cpu")
    msg = str(e.value)
    assert msg.startswith(
        "optim.name=adamw8bit needs bitsandbytes, which cannot be used here (ModuleNotFoundError"
    )
    assert "use optim.name=adamw, or install a bitsandbytes build" in msg and "\n" not in msg
    with pytest.raises(
        DeviceError,
        match=r"^4-bit base weights \(finetune.method=qlora\) needs bitsandbytes.*"
        r"use finetune.method=lora, or",
    ):
        import_bitsandbytes()
