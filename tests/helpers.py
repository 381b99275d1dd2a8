"""Small builders shared by the tests."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

from tr_hydra.config.epochs import make_variants
from tr_hydra.config.plan_config import PlanConfig
from tr_hydra.config.specs import DataSpec, ModelSpec, OptimizerSpec, RuntimeSpec, TrainerSpec


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
        data=DataSpec(num_classes=num_classes),
        trainer=trainer or TrainerSpec(epochs=epochs, max_steps=max_steps, label_smoothing=label_smoothing),
        runtime=RuntimeSpec(device=device, cuda_graph=cuda_graph, compile=compile),
        variants=variants, batch_size=batch, val_batch_size=val_batch, lowres_epochs=lowres_epochs,
        train_size=train_size, val_size=val_size, **kw)


def assert_folding_keeps_the_logits(tr, x) -> None:
    """A fitted trainer's eval-mode logits for ``x`` with BatchNorm folded into the convolutions
    (validation's form) are those of the plain model: each as far from a float64 evaluation of
    the plain model as 16 times the plain float32 model's own error (at least one float32 step of
    the largest logit), and not the same bits (another computation, not the same path)."""
    import copy

    import torch
    tr.model.eval()
    with torch.no_grad():
        ref = copy.deepcopy(tr.model).double()(x.double())
        plain = tr.model(x)
        tr.ex.before_validation()
        with tr.ex.folded():
            folded = tr.model(x)
    err = lambda t: (t.double() - ref).abs().max().item()  # noqa: E731
    floor = torch.finfo(torch.float32).eps * ref.abs().max().item()
    assert err(folded) <= 16 * max(err(plain), floor), (err(folded), err(plain), floor)
    assert not torch.equal(plain, folded)


def fit_stop_resume(base: PlanConfig, root: Path, max_steps: int, **spec):
    """Fits ``base`` with ``TrainerSpec(**spec)`` in ``root/a``; in ``root/b`` stops it after
    ``max_steps`` steps, then resumes it from its checkpoint to the end. Returns the two trainers
    and the names of ``root/b``'s checkpoints at the stop."""
    import dataclasses
    from tr_hydra.train import checkpoint as ck
    from tr_hydra.train.trainer import Trainer

    def fitted(pc, out):
        tr = Trainer(pc, out, log=lambda *_: None)
        tr.fit()
        return tr
    full = fitted(dataclasses.replace(base, trainer=TrainerSpec(**spec)), root / "a")
    fitted(dataclasses.replace(base, trainer=TrainerSpec(**spec, max_steps=max_steps)), root / "b")
    at_stop = [p.name for p in ck.checkpoints_in(root / "b")]
    resumed = fitted(dataclasses.replace(base, trainer=TrainerSpec(**spec), resume="auto"), root / "b")
    return full, resumed, at_stop


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


def assert_second_process_hits_aot_cache(probe: str, tmp_path: Path) -> None:
    """Run ``probe`` (a script that compiles something and prints ``AOT`` and AOTAutograd's
    counters) twice in fresh processes with one Inductor cache: the first saves to
    AOTAutograd's cache, the second loads from it and bypasses nothing, as the parallel
    compiles' children and the trainer rely on."""
    root = Path(__file__).parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    seen = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                             timeout=600, cwd=root)
        assert out.returncode == 0, out.stderr[-3000:]
        seen.append([ln for ln in out.stdout.splitlines() if ln.startswith("AOT")][-1])
    assert "autograd_cache_saved" in seen[0], seen
    assert "autograd_cache_hit" in seen[1] and "autograd_cache_bypass" not in seen[1], seen


class CompiledConfig:
    """What Inductor's ``_precompile_config`` returns: a compiled Triton config that makes its
    launcher (here, itself)."""

    def __init__(self, config):
        self.config = config

    def make_launcher(self):
        return self


class _StandIn:
    """A compiled graph that returns empty tensors shaped as its outputs."""

    def __init__(self, outputs):
        self.outputs = outputs

    def call(self, args):
        import torch
        args.clear()
        return tuple(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                     for v in self.outputs)


@contextlib.contextmanager
def triton_code_on_cpu(outputs=None, **config):
    """Inductor's Triton code for CPU tensors, without a GPU. Within the block every graph
    Inductor compiles is lowered by its Triton backend (``cpu_backend="triton"``, the fusion
    decisions CUDA gets) and its generated module appended to the list yielded; nothing is
    compiled by Triton or run: each graph returns empty tensors shaped as its outputs, which are
    appended to ``outputs`` where given. ``config`` patches further Inductor options. Skips the
    test where Triton or the Inductor internals this patches are missing."""
    import pytest
    pytest.importorskip("triton")
    import torch
    import torch._inductor.codegen.triton as codegen_triton
    import torch._inductor.config as inductor_config
    import torch.utils._triton as utils_triton
    from torch._inductor.graph import GraphLowering
    if not (hasattr(GraphLowering, "codegen") and hasattr(utils_triton, "triton_hash_with_backend")):
        pytest.skip("this PyTorch's Inductor lacks what recording its Triton code on the CPU patches")
    codes: list[str] = []

    def compile_to_module(self):
        code = self.codegen()
        code = code[0] if isinstance(code, tuple) else code
        codes.append(getattr(code, "value", code))
        outs = [n for n in self.module.graph.nodes if n.op == "output"][0].args[0]
        outs = [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in outs]
        if outputs is not None:
            outputs.append(outs)
        return _StandIn(outs)

    no_hash = lambda: "none"  # noqa: E731 (the backend's hash needs a GPU driver)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(GraphLowering, "compile_to_module", compile_to_module))
        stack.enter_context(mock.patch.object(utils_triton, "triton_hash_with_backend", no_hash))
        if hasattr(codegen_triton, "triton_hash_with_backend"):
            stack.enter_context(mock.patch.object(codegen_triton, "triton_hash_with_backend", no_hash))
        # one thread: no compile workers, which would try to build the kernels
        stack.enter_context(inductor_config.patch(
            **{"cpu_backend": "triton", "fx_graph_cache": False, "compile_threads": 1, **config}))
        yield codes


def eager_val_metrics(tr) -> dict:
    """Mean loss, top1, top5 and count of the model as it stands, in eval mode, over the
    validation set."""
    import torch
    import torch.nn.functional as F
    from tr_hydra.config.epochs import val_schedule
    tr.model.eval()
    loss = top1 = top5 = n = 0.0
    with torch.no_grad():
        for v, i, size in val_schedule(tr.pc):
            x, y = tr.source.batch("val", i, tr.pc.variant("val_base").batch, size, tr.pc.variant(v).res)
            logits = tr.model(x.permute(0, 3, 1, 2))
            loss += F.cross_entropy(logits, y.long(), reduction="sum").item()
            top1 += (logits.argmax(1) == y).sum().item()
            top5 += (logits.topk(5, 1).indices == y[:, None]).any(1).sum().item()
            n += size
    tr.model.train()
    return {"loss": loss / n, "top1": 100 * top1 / n, "top5": 100 * top5 / n, "count": n}


def rel_err(a, b) -> float:
    """``|a - b| / |b|`` in float64 (relative norm)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def is_decayed(model, name: str) -> bool:
    """Whether ``name`` decays where the optimizer excludes BN and biases: only convolution and
    linear weights do (torchvision's reference recipe without decay on norms and biases)."""
    import torch.nn as nn
    mod = dict(model.named_modules())[name.rpartition(".")[0]]
    return name.endswith("weight") and isinstance(mod, (nn.Conv2d, nn.Linear))


def torch_optimizer(name, lr, wd, exclude, momentum=0.9, betas=(0.9, 0.999), eps=1e-8):
    """``make(model)``: torch.optim's optimizer ``name`` over ``model``, decay on ``is_decayed``
    parameters only when ``exclude``: the reference for tr_hydra's updates."""
    import torch

    def make(model):
        if exclude:
            decay = [p for n, p in model.named_parameters() if is_decayed(model, n)]
            rest = [p for n, p in model.named_parameters() if not is_decayed(model, n)]
            groups = [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]
        else:
            groups = [{"params": list(model.parameters()), "weight_decay": wd}]
        if name == "sgd":
            return torch.optim.SGD(groups, lr=lr)
        if name in ("momentum", "nesterov"):
            return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=name == "nesterov")
        if name == "adam":
            return torch.optim.Adam(groups, lr=lr, betas=betas, eps=eps)
        if name == "adamw":
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
        raise ValueError(name)
    return make
