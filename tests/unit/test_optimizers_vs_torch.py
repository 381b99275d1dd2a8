"""K steps of tr_hydra equal K steps of torch.optim (fp32, CPU), BN running stats included."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tr_hydra.compiler.compile import instantiate_model
from tr_hydra.config.plan_config import OptimizerSpec
from tr_hydra.runtime.schedule import epoch_schedule
from tr_hydra.train.trainer import Trainer

from tests.helpers import small_config


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def _is_decayed(model: nn.Module, name: str) -> bool:
    mod = dict(model.named_modules())[name.rpartition(".")[0]]
    return name.endswith("weight") and isinstance(mod, (nn.Conv2d, nn.Linear))


# The reference is torch.optim on the same model in fp32, NCHW: tr_hydra computes NCHW on CPU
# too (see runtime.model_prep.nchw_compute_on_cpu for why), so both run the same kernels.
def _reference(pc, steps, source, make_opt, dtype=torch.float32):
    torch.manual_seed(pc.seed)
    model = instantiate_model(pc).to(dtype)
    model.train()
    opt = make_opt(model)
    for v, i, size in steps:
        x, y = source.batch("train", i, pc.batch_size, size, pc.variant(v).res)
        loss = F.cross_entropy(model(x.permute(0, 3, 1, 2).to(dtype).contiguous()), y.long())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _torch_opt(name, lr, wd, exclude, momentum=0.9, betas=(0.9, 0.999), eps=1e-8):
    def make(model):
        if exclude:
            decay = [p for n, p in model.named_parameters() if _is_decayed(model, n)]
            rest = [p for n, p in model.named_parameters() if not _is_decayed(model, n)]
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


CASES = [
    ("sgd", 0.1, 0.0, 5e-4), ("momentum", 0.05, 0.9, 5e-4), ("nesterov", 0.05, 0.9, 5e-4),
    ("adam", 1e-3, 0.0, 1e-4), ("adamw", 1e-3, 0.0, 0.05),
]


@pytest.mark.parametrize("name,lr,momentum,wd", CASES)
@pytest.mark.parametrize("exclude", [True, False])
def test_resnet_mini_matches_torch_optim(tmp_path, name, lr, momentum, wd, exclude):
    """4 steps, fp32 both sides: every tensor within 1e-5 (relative norm), BN statistics too."""
    opt = OptimizerSpec(name=name, lr=lr, momentum=momentum, weight_decay=wd,
                        wd_exclude_bn_bias=exclude, schedule="constant")
    pc = small_config(optimizer=opt, batch=32, train_size=128, val_size=32, res=16)
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    steps = epoch_schedule(pc, 0)[:4]
    tr.run_steps(steps, "train")
    got = tr.final_state_dict()
    ref = _reference(pc, steps, tr.source, _torch_opt(name, lr, wd, exclude, momentum or 0.9))
    for key, want in ref.state_dict().items():
        if key.endswith("num_batches_tracked"):
            assert int(got[key]) == 4
            continue
        err = _rel(got[key], want)
        assert err <= 1e-5, f"{key}: relative error {err:.2e}"


@pytest.mark.parametrize("name,lr,momentum,wd", CASES)
def test_resnet18_cifar_as_exact_as_pytorch(tmp_path, name, lr, momentum, wd):
    """resnet18_cifar on 16-image batches is ill-conditioned: one lr=0.1 SGD step moves conv1 by
    30% of its norm, and from the second step its BN-bias gradients nearly cancel, so after 2
    steps fp32 runs that differ only in rounding (PyTorch's own, with the batch in another order,
    or on another CPU's kernels) land 1e-6 or 1e-3..1e-2 away from float64 on those tensors, and
    no fp32 implementation can promise 1e-5 there; which tensors, and how many (31..102 of 102
    within 1e-5, measured), depends on the machine. So every bound is a reference computed here,
    against torch.optim in float64: step 1 (well conditioned) per tensor within 10x PyTorch
    fp32's own error; step 2 per tensor within 10x the larger error of two PyTorch fp32 runs, its
    own and one whose step 2 starts from tr_hydra's step-1 weights and statistics (so it shares
    tr_hydra's rounding there); and as a whole as exact as those: the i-th smallest error of
    tr_hydra's within 2x the i-th smallest of the less exact PyTorch run, for every i (so at
    least as many tensors within 2t as PyTorch has within t, for any t, 1e-5 included)."""
    import copy
    lr = lr * 0.1
    opt = OptimizerSpec(name=name, lr=lr, momentum=momentum, weight_decay=wd,
                        wd_exclude_bn_bias=False, schedule="constant")
    pc = small_config(model="resnet18_cifar", optimizer=opt, batch=16, train_size=32, val_size=16,
                      res=16, val_res=16)
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    steps = epoch_schedule(pc, 0)[:2]
    tr.run_steps(steps[:1], "train")
    got1 = tr.final_state_dict()
    tr.run_steps(steps[1:], "train", step0=1)
    got2 = tr.final_state_dict()
    make = _torch_opt(name, lr, wd, False, momentum or 0.9)

    def torch_run(dtype):
        """torch.optim on the same model and batches (as _reference): the state after each
        step; in fp32 also step 2 of the same model and optimizer from tr_hydra's step 1."""
        torch.manual_seed(pc.seed)
        model = instantiate_model(pc).to(dtype)
        model.train()
        runs = [(model, make(model))]
        after = [[] for _ in range(2)]
        for j, (v, i, size) in enumerate(steps):
            if j == 1 and dtype == torch.float32:
                fork = copy.deepcopy(runs[0])  # the optimizer's own state after step 1 kept
                fork[0].load_state_dict(got1)
                runs.append(fork)
            x, y = tr.source.batch("train", i, pc.batch_size, size, pc.variant(v).res)
            for r, (m, o) in enumerate(runs):
                loss = F.cross_entropy(m(x.permute(0, 3, 1, 2).to(dtype).contiguous()), y.long())
                o.zero_grad()
                loss.backward()
                o.step()
                sd = m.state_dict()  # the last step's as it is: nothing moves it after
                after[r].append({k: t.detach().clone() for k, t in sd.items()} if j == 0 else sd)
        return after

    (exact1, exact2), _ = torch_run(torch.float64)
    (fp32_1, fp32_2), (from_ours,) = torch_run(torch.float32)
    keys = [k for k in exact2 if not k.endswith("num_batches_tracked")]
    for key in set(exact2) - set(keys):
        assert int(got1[key]) == 1 and int(got2[key]) == 2
    # no bound is 0: every fp32 tensor is at least as far from float64 as float64 rounded to fp32
    for k in keys:
        err, bound = _rel(got1[k], exact1[k]), 10 * _rel(fp32_1[k], exact1[k])
        assert err <= bound, f"step 1, {k}: {err:.2e} > {bound:.2e} (10x PyTorch fp32's own)"
    ours = {k: _rel(got2[k], exact2[k]) for k in keys}
    theirs = {k: _rel(fp32_2[k], exact2[k]) for k in keys}
    theirs_from_ours = {k: _rel(from_ours[k], exact2[k]) for k in keys}
    for k in keys:
        bound = 10 * max(theirs[k], theirs_from_ours[k])
        assert ours[k] <= bound, (f"{k}: {ours[k]:.2e} > {bound:.2e} (10x PyTorch fp32's own "
                                  f"{theirs[k]:.2e}, from tr_hydra's step 1 {theirs_from_ours[k]:.2e})")
    ranked = sorted(ours.values())
    worse = [max(a, b) for a, b in zip(sorted(theirs.values()), sorted(theirs_from_ours.values()))]
    within = lambda errs, t: sum(e <= t for e in errs)
    for i, (e, w) in enumerate(zip(ranked, worse)):
        assert e <= 2 * w, (
            f"tr_hydra's {i + 1}-th most exact tensor is {e:.2e} from float64, PyTorch fp32's {w:.2e}; "
            f"within 1e-5: tr_hydra {within(ranked, 1e-5)}/{len(keys)} (within 2e-5: "
            f"{within(ranked, 2e-5)}), PyTorch {within(theirs.values(), 1e-5)}, from tr_hydra's "
            f"step 1 {within(theirs_from_ours.values(), 1e-5)}")


def _lars_reference(pc, steps, source, lr, wd, tc, mom, eps):
    """LARS written plainly, one parameter at a time."""
    torch.manual_seed(pc.seed)
    model = instantiate_model(pc)
    bufs = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for v, i, size in steps:
        x, y = source.batch("train", i, pc.batch_size, size, pc.variant(v).res)
        model.zero_grad()
        F.cross_entropy(model(x.permute(0, 3, 1, 2).contiguous()), y.long()).backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                g = p.grad
                if _is_decayed(model, n):
                    wn, gn = p.norm(), g.norm()
                    trust = tc * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
                    d = (g + wd * p) * trust
                else:
                    d = g.clone()  # BN and bias: plain momentum, no decay
                bufs[n] = mom * bufs[n] + d
                p -= lr * bufs[n]
    return model


def test_lars_matches_plain_reference(tmp_path):
    opt = OptimizerSpec(name="lars", lr=2.0, momentum=0.9, weight_decay=5e-4, trust_coefficient=0.02,
                        eps=1e-9, schedule="constant")
    pc = small_config(optimizer=opt, train_size=128)
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    steps = epoch_schedule(pc, 0)[:2]  # batch 2 of this data has near-cancelling BN-bias gradients
    tr.run_steps(steps, "train")
    got = tr.final_state_dict()
    ref = _lars_reference(pc, steps, tr.source, 2.0, 5e-4, 0.02, 0.9, 1e-9)
    for key, want in ref.state_dict().items():
        if not key.endswith("num_batches_tracked"):
            assert _rel(got[key], want) <= 1e-5, key
    # the N region holds |w|, |g| and the trust ratio of every conv / fc weight
    from tr_hydra.memory.regions import Region as R
    norms = tr.arena.span(R.N_FC_WEIGHT, R.N_DEEP_CONV).view(-1, 128)
    n_weights = sum(1 for m in ref.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    assert norms.shape[0] == n_weights and bool((norms[:, 0] > 0).all()) and bool((norms[:, 2] > 0).all())
