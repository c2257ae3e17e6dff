"""Faults for ``tests/test_faults.py``, chosen at run time by the JSON file that
``DRPO_TEST_FAULT_FILE`` names (read on every call, so one Ray cluster serves every test):
``{"fault": NAME, "step": K, "marker": PATH, "rank": R}``, K counting from 1 in each process
(of data-parallel rank R only, if given).

- ``kill_actor``: the actor process SIGKILLs itself at its K-th optimizer step;
- ``nan_loss`` / ``nan_grad``: the K-th optimizer step's loss / one parameter's gradient is NaN;
- ``slow_save``: the K-th checkpoint save writes ``marker`` after the model states and then
  sleeps (the test kills the job meanwhile);
- ``enospc_save``: the K-th checkpoint save fails with "No space left on device";
- ``engine_start``: the K-th vLLM engine configuration in a process fails (the engine's
  start-up, as a bad TP size, memory or device would fail it).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

_calls: dict[str, int] = {}


def _fault(kind: str) -> dict | None:
    """The configured fault if it is of ``kind`` and this is its K-th call in this process."""
    path = os.environ.get("DRPO_TEST_FAULT_FILE")
    config = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
    if config.get("fault") not in kind.split("|"):
        return None
    if "rank" in config:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() != config["rank"]:
            return None
    _calls[kind] = _calls.get(kind, 0) + 1
    return config if _calls[kind] == config["step"] else None


def _patch_actor_trainer(module) -> None:
    step = module.DRPOActorTrainer._drpo_optimizer_step
    surrogate = module.surrogate_loss

    def faulty_step(self, *args, **kwargs):
        fault = _fault("kill_actor|nan_loss|nan_grad")
        if fault and fault["fault"] == "kill_actor":
            print("FAULT: actor killed in its optimizer step", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        hook = None
        if fault and fault["fault"] == "nan_loss":
            print("FAULT: NaN loss", flush=True)
            module.surrogate_loss = lambda *a: surrogate(*a) * float("nan")
        if fault and fault["fault"] == "nan_grad":
            print("FAULT: NaN gradient", flush=True)
            first = next(self.actor.parameters())
            hook = first.register_hook(lambda grad: grad * float("nan"))
        try:
            return step(self, *args, **kwargs)
        finally:
            module.surrogate_loss = surrogate
            if hook is not None:
                hook.remove()

    module.DRPOActorTrainer._drpo_optimizer_step = faulty_step


def _patch_deepspeed_engine(module) -> None:
    save = module.DeepSpeedEngine._save_zero_checkpoint

    def faulty_save(self, *args, **kwargs):
        fault = _fault("slow_save|enospc_save")
        if fault and fault["fault"] == "enospc_save":
            print("FAULT: disk full while saving", flush=True)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if fault and fault["fault"] == "slow_save":
            Path(fault["marker"]).write_text("saving")
            time.sleep(600)
        return save(self, *args, **kwargs)

    module.DeepSpeedEngine._save_zero_checkpoint = faulty_save


def _patch_vllm_engine_args(module) -> None:
    create = module.EngineArgs.create_engine_config

    def faulty_create(self, *args, **kwargs):
        if _fault("engine_start"):
            print("FAULT: vLLM engine start", flush=True)
            raise ValueError("injected: this vLLM engine cannot start")
        return create(self, *args, **kwargs)

    module.EngineArgs.create_engine_config = faulty_create


PATCHES = {
    "drpo_openrlhf.update.actor_trainer": _patch_actor_trainer,
    "deepspeed.runtime.engine": _patch_deepspeed_engine,
    "vllm.engine.arg_utils": _patch_vllm_engine_args,
}
