"""The torchvision classifiers of ``model=`` (CHECKED): two of tr_hydra's training steps equal two steps of
torch.optim on torchvision's own model, from the same init, batches and random masks (dropout,
stochastic depth), the plan's layout holds, and ``model_final.pt`` loads into torchvision's model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchvision

from tr_hydra.compiler.compile import compile_plan, instantiate_model
from tr_hydra.config.epochs import epoch_schedule
from tr_hydra.config.specs import OptimizerSpec
from tr_hydra.models.registry import TORCHVISION
from tr_hydra.train.trainer import Trainer

from tests.helpers import rel_err, small_config, torch_optimizer

NEW = [m for m in TORCHVISION if m not in ("resnet18", "resnet34", "resnet50")]
# resnet152 and wide_resnet50_2 are resnet101's bottleneck blocks, more of them or wider: on the
# CPU (within CI's time) resnet101 stands for them; tests/gpu/test_cuda_models.py trains all
CHECKED = [m for m in NEW if m not in ("resnet152", "wide_resnet50_2")]
# each model with one of the optimizers torch.optim has (LARS: test_optimizers_vs_torch). Adam
# on convnext_tiny and AdamW on mobilenet_v3_large land 12x and 14x PyTorch fp32's distance at
# these tiny batches: the update of a weight whose gradient is near eps turns every rounding of
# the gradient into a move of up to lr, so those two take momentum SGD
OPT = {"adamw": ("adamw", 1e-3, 0.0, 0.05), "adam": ("adam", 1e-3, 0.0, 1e-4), "sgd": ("sgd", 0.05, 0.0, 5e-4),
       "momentum": ("momentum", 0.02, 0.9, 5e-4), "nesterov": ("nesterov", 0.02, 0.9, 5e-4)}
OPTIMIZER = {"resnet101": "adamw", "resnext50_32x4d": "momentum", "regnet_y_1_6gf": "nesterov",
             "mobilenet_v2": "adam", "mobilenet_v3_large": "momentum", "efficientnet_b0": "adamw",
             "efficientnet_v2_s": "sgd", "densenet121": "adam", "convnext_tiny": "momentum"}
SEEDS = (11, 12)  # the generator's seed before each step: the same masks on both sides
# 32x32 leaves these models' last BatchNorms 4 numbers a channel at batch 4: so ill-conditioned
# that PyTorch's own fp32 runs land 1e-2 from float64 and one rounding more moves 10x that
RES = {"mobilenet_v2": 64, "mobilenet_v3_large": 64, "efficientnet_b0": 64, "efficientnet_v2_s": 64}


@pytest.mark.parametrize("model", CHECKED)
def test_two_steps_match_torch_optim_on_the_torchvision_model(tmp_path, model):
    """Per tensor (weights and BN statistics) after two steps: tr_hydra's distance from a float64
    run of torch.optim is within 10x the distance of PyTorch's own fp32 run, in whichever of NCHW
    and channels_last is the less exact (PyTorch's CPU kernels round differently by layout), or
    of the float64 result rounded to fp32."""
    name, lr, momentum, wd = OPT[OPTIMIZER[model]]
    opt = OptimizerSpec(name=name, lr=lr, momentum=momentum, weight_decay=wd, wd_exclude_bn_bias=True,
                        schedule="constant")
    res = RES.get(model, 32)
    pc = small_config(model=model, optimizer=opt, batch=4, val_batch=4, train_size=8, val_size=4,
                      res=res, lowres_res=res, val_res=res)
    compile_plan(pc).plan.validate()  # the four layout validations
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    steps = epoch_schedule(pc, 0)[:2]
    for k, seed in enumerate(SEEDS):
        torch.manual_seed(seed)
        tr.run_steps(steps[k:k + 1], "train", step0=k)
    got = tr.final_state_dict()
    # model_final.pt loads, strictly, into torchvision's model of that name
    final = torch.load(tr.checkpointer.save_final(), map_location="cpu", weights_only=True)
    getattr(torchvision.models, model)(num_classes=pc.model.num_classes).load_state_dict(final, strict=True)
    data = [tr.source.batch("train", i, pc.batch_size, size, pc.variant(v).res) for v, i, size in steps]

    def reference(dtype, channels_last=False):
        torch.manual_seed(pc.seed)
        m = instantiate_model(pc).to(dtype).train()
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        m = m.to(memory_format=fmt)
        o = torch_optimizer(name, lr, wd, True, momentum)(m)
        for (x, y), seed in zip(data, SEEDS):
            torch.manual_seed(seed)
            loss = F.cross_entropy(m(x.permute(0, 3, 1, 2).to(dtype).contiguous(memory_format=fmt)), y.long())
            o.zero_grad()
            loss.backward()
            o.step()
        return {k: t.detach().clone() for k, t in m.state_dict().items()}

    exact, nchw, cl = reference(torch.float64), reference(torch.float32), reference(torch.float32, True)
    assert set(got) == set(exact)
    for key, want in exact.items():
        if key.endswith("num_batches_tracked"):
            assert int(got[key]) == 2, key
            continue
        err = rel_err(got[key], want)
        bound = 10 * max(rel_err(nchw[key], want), rel_err(cl[key], want), rel_err(want.float(), want))
        assert err <= bound, f"{model} {key}: {err:.2e} from float64 > {bound:.2e} (10x PyTorch fp32's)"


def test_the_torch_optim_check_can_fail(tmp_path):
    """The check above tells a wrong step: a run whose second step draws other masks (another
    seed) is not within the bound on a model with dropout and stochastic depth."""
    pc = small_config(model="efficientnet_b0", optimizer=OptimizerSpec(name="sgd", lr=0.05, schedule="constant"),
                      batch=4, val_batch=4, train_size=8, val_size=4, res=32, lowres_res=32, val_res=32)
    runs = []
    for seeds in (SEEDS, (SEEDS[0], 99)):
        tr = Trainer(pc, tmp_path / str(seeds[1]), log=lambda *_: None)
        steps = epoch_schedule(pc, 0)[:2]
        for k, seed in enumerate(seeds):
            torch.manual_seed(seed)
            tr.run_steps(steps[k:k + 1], "train", step0=k)
        runs.append(tr.final_state_dict()["classifier.1.weight"])
    assert rel_err(runs[1], runs[0]) > 1e-4
