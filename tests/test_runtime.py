"""bitsandbytes is loaded quietly, and a build that cannot load is one message."""

from __future__ import annotations

import sys

import pytest


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
