"""ArenaKeeper: bind puts every parameter, gradient and statistic at its planned offset."""
from __future__ import annotations

import pytest
import torch

from tr_hydra.compiler.compile import compile_plan, instantiate_model
from tr_hydra.memory.arena import ArenaKeeper

from tests.helpers import small_config


@pytest.mark.parametrize("amp,ema", [(False, False), (True, True)])
def test_bind_places_everything_at_planned_offsets(amp, ema):
    pc = small_config(amp=amp, ema=ema, lowres_epochs=1)
    c = compile_plan(pc)
    torch.manual_seed(0)
    model = instantiate_model(pc)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    arena = ArenaKeeper(c.plan, "cpu")
    arena.bind(model, amp=amp, ema=ema)
    base = arena.arena.data_ptr()
    plan = c.plan
    for name, p in model.named_parameters():
        master = plan[name]
        if amp and master.kind in ("FC_WEIGHT", "FIRST_CONV", "DEEP_CONV"):
            assert p.data_ptr() == base + plan["amp." + name].offset and p.dtype == torch.bfloat16
            assert p.grad.data_ptr() == base + plan["grad16." + name].offset
        else:
            assert p.data_ptr() == base + master.offset and p.dtype == torch.float32
            assert p.grad.data_ptr() == base + plan["grad." + name].offset
        # the master holds the model's initial values exactly
        assert torch.equal(arena.torch_view(master), reference[name])
        if p.dim() == 4:
            assert p.is_contiguous(memory_format=torch.channels_last)
    for name, b in model.named_buffers():
        assert b.data_ptr() == base + plan[name].offset
        assert torch.equal(b, reference[name])


def test_variant_views_share_one_offset():
    pc = small_config(lowres_epochs=1, train_size=200, batch=32, val_size=70, val_batch=32)
    c = compile_plan(pc)
    arena = ArenaKeeper(c.plan, "cpu")
    names = [v.name for v in pc.variants]
    assert len(names) == 6
    base = arena.arena.data_ptr()
    assert set(c.plan.variant_shapes["input_A.data"]) == set(names)
    for t in c.plan.dtensors:
        if t.name not in c.plan.variant_shapes:
            continue
        for v in c.plan.variant_shapes[t.name]:
            view = arena.view(t, v)
            assert view.data_ptr() == base + t.offset
            assert view.numel() * view.element_size() <= t.slot_bytes


def test_state_dict_round_trip_loads_into_fresh_model():
    pc = small_config(model="resnet18_cifar")
    c = compile_plan(pc)
    torch.manual_seed(1)
    model = instantiate_model(pc)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    arena = ArenaKeeper(c.plan, "cpu")
    arena.bind(model, amp=False, ema=False)
    sd = arena.state_dict_from_arena(model, step_count=7)
    fresh = instantiate_model(pc)
    fresh.load_state_dict(sd)
    for k, v in want.items():
        if k.endswith("num_batches_tracked"):
            assert int(sd[k]) == 7
        else:
            assert torch.equal(sd[k], v), k


@pytest.mark.parametrize("amp", [False, True])
def test_dynamo_traces_the_bound_model_with_static_shapes(amp):
    """The bound parameters, gradients and statistics are not views of the arena's flat tensors.
    A view as a parameter's ``.grad`` gets a symbolic context of its own in Dynamo: every size,
    stride and offset of the gradient (and of its base) becomes a symbol, then a guard; that made
    each trace of ResNet-50 3-4x slower. Traced with ``dynamic=False``, the bound model creates no
    symbol, as a plain model does."""
    import torch._dynamo as dynamo
    from torch._guards import detect_fake_mode

    pc = small_config(amp=amp)
    c = compile_plan(pc)
    model = instantiate_model(pc)
    ArenaKeeper(c.plan, "cpu").bind(model, amp=amp, ema=False)
    for p in model.parameters():
        assert p.grad is not None and p.grad._base is None and p._base is None
    for b in model.buffers():
        assert b._base is None
    seen = []

    def backend(gm, example_inputs):
        env = detect_fake_mode(example_inputs).shape_env  # the symbols it traced with (renamed in torch 2.14)
        seen.append(dict(env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val))
        return gm.forward
    dynamo.reset()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        torch.compile(model.eval(), backend=backend, dynamic=False)(x)
    dynamo.reset()
    assert seen and all(s == {} for s in seen), seen
