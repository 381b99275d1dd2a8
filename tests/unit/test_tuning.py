"""runtime.tuning: the run's steps per variant, the FLOP count, and the choice's arithmetic."""
import dataclasses

import pytest
import torch.nn as nn

from tr_hydra.cli._common import compose
from tr_hydra.compiler import tuning
from tr_hydra.config.epochs import epoch_schedule, val_schedule
from tr_hydra.internals.compile import inductor_map
from tr_hydra.internals.upcast_per_use import PASS
from tr_hydra.resolve import resolve


def _pc(*overrides):
    return resolve(compose(list(overrides)))


SMALL = ("model=resnet_mini", "variants.train_size=1000", "variants.batch_size=64", "variants.val_size=300",
         "variants.val_batch_size=128", "variants.base_res=32", "variants.lowres_res=24", "variants.val_res=32")


def _trainer_steps(pc) -> dict:
    """The reference: the trainer's own schedules, epoch by epoch, as it walks them (validation
    after each whole epoch that val_every names and after the last, twice with EMA)."""
    counts, step = {}, 0
    for epoch in range(pc.trainer.epochs):
        sched = epoch_schedule(pc, epoch)
        if pc.trainer.max_steps:
            sched = sched[:max(pc.trainer.max_steps - step, 0)]
        if not sched:
            break
        for v, _, _ in sched:
            counts[v] = counts.get(v, 0) + 1
        whole = len(sched) == len(epoch_schedule(pc, epoch))
        step += len(sched)
        if whole and ((epoch + 1) % pc.trainer.val_every == 0 or epoch + 1 == pc.trainer.epochs):
            for _ in range(2 if pc.ema else 1):
                for v, _, _ in val_schedule(pc):
                    counts[v] = counts.get(v, 0) + 1
    return counts


@pytest.mark.parametrize("extra", [
    (),
    ("variants.lowres_epochs=2", "trainer.epochs=5", "trainer.val_every=2"),
    ("trainer.epochs=4", "trainer.max_steps=40"),   # stops inside epoch 3: no validation after it
    ("trainer.epochs=3", "ema=true"),
    ("variants.train_size=1024", "variants.val_size=256", "trainer.epochs=3"),  # no partial last batches
])
def test_run_steps_are_the_trainers_schedule(extra):
    pc = _pc(*SMALL, *extra)
    assert tuning.run_steps(pc) == _trainer_steps(pc)


def test_run_steps_by_hand():
    # 1000 images at 64: 15 full batches and one of 40; 300 at 128: 2 and one of 44
    pc = _pc(*SMALL, "trainer.epochs=3", "variants.lowres_epochs=1", "trainer.val_every=2")
    assert tuning.run_steps(pc) == {"train_lowres": 15, "train_lowres_last": 1, "train_base": 30, "train_last": 2,
                                    "val_base": 4, "val_last": 2}


def test_forward_flops_of_a_small_net_by_hand():
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).to("meta")
    # two FLOPs per multiply-add: 16x16 outputs x 8 channels x 3x3x3 taps; 8 x 10 for the linear
    assert tuning.forward_flops(net, 3, 16) == 2 * 16 * 16 * 8 * 27 + 2 * 8 * 10
    assert tuning.forward_flops(net, 3, 32) == 2 * 32 * 32 * 8 * 27 + 2 * 8 * 10
    assert net.training  # left as it was


def test_each_variant_weighs_its_saving_against_its_cost():
    """A variant is tuned when GAIN of its steps' estimated seconds exceeds TUNE_SECONDS_PER_NORM
    per BatchNorm layer (VAL_SHARE of it for a validation variant), each computed here by hand."""
    pc = _pc(*SMALL, "trainer.epochs=3")
    steps = tuning.run_steps(pc)
    assert set(steps) == {"train_base", "train_last", "val_base", "val_last"}
    flops = {32: 1.234567e15}  # train_base's even point between two whole numbers of layers
    seconds = {v: n * (3 if pc.variant(v).train else 1) * flops[32] * pc.variant(v).batch / tuning.STEP_FLOPS_PER_S
               for v, n in steps.items()}
    # the BatchNorm layers at which train_base's saving equals its cost: one fewer tunes it
    even = tuning.GAIN * seconds["train_base"] / tuning.TUNE_SECONDS_PER_NORM
    norms = int(even)
    choice = tuning.choose(pc, "cuda", True, flops, norms)
    want = {}
    for v, sec in seconds.items():
        cost = tuning.TUNE_SECONDS_PER_NORM * norms * (1 if pc.variant(v).train else tuning.VAL_SHARE)
        want[v] = tuning.GAIN * sec > cost
        e = choice.estimates[v]
        assert e.steps == steps[v] and e.seconds == pytest.approx(sec)
        assert e.saving == pytest.approx(tuning.GAIN * sec) and e.cost == pytest.approx(cost)
    assert want["train_base"] and not want["train_last"]  # 45 steps of 64 against 3 of 40
    assert choice.variants == tuple(v for v in steps if want[v]) and choice.tune
    assert choice.describe().startswith("runtime.tuning=auto: coordinate descent on train_base")
    assert "train_last: 3 steps of about" in choice.describe() and "below the tuning's" in choice.describe()
    none = tuning.choose(pc, "cuda", True, flops, int(even) + 1)
    assert not none.tune and none.variants == ()
    assert none.describe().startswith("runtime.tuning=auto: no tuning (train_base: ")
    js = choice.to_json()
    assert js["variants"] == list(choice.variants) and js["estimates"]["train_base"]["tune"] is True


def test_the_choice_on_the_cpu_without_inductor_and_as_asked():
    pc = _pc(*SMALL)
    assert not tuning.choose(pc, "cpu", True, {}, 3).tune
    assert "on the CPU" in tuning.choose(pc, "cpu", True, {}, 3).reason
    assert "runtime.compile=none" in tuning.choose(pc, "cuda", False, {}, 3).reason
    full = _pc(*SMALL, "runtime.tuning=full")
    assert tuning.choose(full, "cuda", True, {}, 3).variants == ("train_base", "train_last", "val_base", "val_last")
    assert not tuning.choose(full, "cpu", True, {}, 3).tune  # nothing to tune there
    assert not tuning.choose(_pc(*SMALL, "runtime.tuning=none"), "cuda", True, {}, 3).tune


def test_resolved_config_and_the_options_it_compiles_with():
    """The runtime's config carries the choice (full or none), which adds coordinate descent to
    Inductor's options, and a second resolution (a parallel compile's) keeps it."""
    from tr_hydra.compiler.compile import instantiate_model
    long = _pc("recipe=resnet50_imagenet_mlperf", "data=synthetic", "variants.train_size=1281167",
               "variants.val_size=50000", "runtime.device=cuda")
    short = dataclasses.replace(long, trainer=dataclasses.replace(long.trainer, epochs=2),
                                train_size=16384, val_size=512)
    model = instantiate_model(long, "meta")
    got, choice = tuning.resolve(long, model, "cuda", True)
    # the full training batch, not the partial one of each epoch nor validation
    assert choice.variants == ("train_base",) and got.runtime.tuning == "full" and got.tuned_variants == ("train_base",)
    assert [v.name for v in got.variants if got.tunes(v.name)] == ["train_base"]
    # each of its kernels weighed over the run's 37 x 5,004 steps of it; the others not tuned at all
    assert got.tuned_steps == (37 * 5004,) and choice.steps == (37 * 5004,)
    assert [got.steps_to_pay(v.name) for v in got.variants] == [37 * 5004, None, None, None]
    assert "of those, each kernel where 10% of its launches' time over the run exceeds the 1 s" in choice.describe()
    assert inductor_map(got.runtime) == {"coordinate_descent_tuning": True, "post_grad_custom_post_pass": PASS}
    again, second = tuning.resolve(got, model, "cuda", True)
    assert again == got and second.variants == ("train_base",) and second.reason == "as asked"
    got, choice = tuning.resolve(short, model, "cuda", True)
    assert not choice.tune and got.runtime.tuning == "none" and inductor_map(got.runtime) == {"post_grad_custom_post_pass": PASS}
    assert not any(got.tunes(v.name) for v in got.variants)
    asked = dataclasses.replace(short, runtime=dataclasses.replace(short.runtime, tuning="full"))
    got, choice = tuning.resolve(asked, model, "cuda", True)
    assert all(got.tunes(v.name) for v in got.variants) and choice.variants == tuple(v.name for v in got.variants)
    assert got.tuned_steps is None and not any(got.steps_to_pay(v.name) for v in got.variants)  # every kernel
    # the ImageNet run's estimate: 37 epochs of 5,005 steps and 196 validation steps, at the
    # figures measured on the H200 (a 256x224 step in 34.9 ms: 3 x 8.18 GFLOP x 256 / 1.8e14)
    assert tuning.run_steps(long) == {"train_base": 37 * 5004, "train_last": 37, "val_base": 37 * 195,
                                      "val_last": 37}
    flops = tuning.forward_flops(model, 3, 224)
    assert 8.0e9 < flops < 8.4e9  # ResNet-50's 4.1 G multiply-adds at 224²
