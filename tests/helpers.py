"""Small builders shared by the tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tr_hydra.config.plan_config import (DataSpec, ModelSpec, OptimizerSpec, PlanConfig, RuntimeSpec,
                                         TrainerSpec, make_variants)


def small_config(*, model="resnet_mini", optimizer=None, train_size=200, val_size=60, batch=32,
                 val_batch=32, res=16, lowres_res=12, lowres_epochs=0, val_res=16, epochs=1,
                 max_steps=None, device="cpu", cuda_graph=True, compile="none", num_classes=10,
                 label_smoothing=0.0, trainer=None, **kw) -> PlanConfig:
    variants = make_variants(train_size=train_size, val_size=val_size, batch_size=batch,
                             val_batch_size=val_batch, base_res=res, lowres_res=lowres_res,
                             lowres_epochs=lowres_epochs, val_res=val_res, drop_last=False)
    return PlanConfig(
        model=ModelSpec(name=model, num_classes=num_classes),
        optimizer=optimizer or OptimizerSpec(name="momentum", lr=0.05, schedule="constant"),
        data=DataSpec(num_classes=num_classes, image_size=res),
        trainer=trainer or TrainerSpec(epochs=epochs, max_steps=max_steps, label_smoothing=label_smoothing),
        runtime=RuntimeSpec(device=device, cuda_graph=cuda_graph, compile=compile),
        variants=variants, batch_size=batch, val_batch_size=val_batch, lowres_epochs=lowres_epochs,
        train_size=train_size, val_size=val_size, **kw)


def run_script_with_caches(script: str, cache: Path, *args: str) -> dict:
    """Run ``script`` in a fresh Python process with Inductor's and Triton's caches under
    ``cache`` (so a second call with the same ``cache`` loads what the first compiled); returns
    the JSON of its last ``RESULT `` line."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])
