"""torch models, optimizers and schedulers through checkpoints, bitwise, without pickle.

Train a model with BatchNorm under AdamW + OneCycleLR for some steps, save parameters,
buffers and the optimizer's and scheduler's state; load them into fresh objects and train on:
the result is bitwise the run never interrupted, in float32 and in half precision (bfloat16,
which NumPy lacks, travels as its bits).
"""

import numpy as np
import pytest

from tensorplay_mpi import checkpoint
from tensorplay_mpi.checkpoint import _torch_state as torch_state

torch = pytest.importorskip("torch")

STEPS = 6


def fresh(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Linear(3, 2)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1,
                            eps=1e-8 if dtype == torch.float32 else 1e-3)  # float16 has 6e-8
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)
    return model, opt, sched


def train(model, opt, sched, steps):
    dtype = next(model.parameters()).dtype
    for t in steps:
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        x, y = x.to(dtype), y.to(dtype)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        sched.step()


def everything(model, opt, sched):
    state = torch_state.state_arrays(opt, "o") | torch_state.state_arrays(sched, "s")
    return [bits(t) for t in model.state_dict().values()] + [v for k, v in sorted(state.items())]


def bits(t):
    """`t`'s values as an array that compares bitwise (bfloat16: its int16 bits)."""
    t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().copy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_checkpoint_of_a_torch_run_resumes_bitwise(tmp_path, dtype):
    never_stopped = fresh(dtype)
    train(*never_stopped, range(STEPS))

    first = fresh(dtype)
    train(*first, range(3))
    model, opt, sched = first
    extra = {**torch_state.state_arrays(opt, "opt"), **torch_state.state_arrays(sched, "sched")}
    checkpoint.save(tmp_path, model.parameters(), buffers=model.buffers(), extra=extra, step=3)
    with np.load(tmp_path / checkpoint.MANIFEST, allow_pickle=False) as saved:
        assert all(saved[name].dtype != object for name in saved.files)

    model, opt, sched = resumed = fresh(dtype)
    state = checkpoint.load(tmp_path, model.parameters(), buffers=model.buffers())
    torch_state.load_state_arrays(opt, state.extra, "opt")
    torch_state.load_state_arrays(sched, state.extra, "sched")
    assert all(p.requires_grad for p in model.parameters())
    train(*resumed, range(state.step, STEPS))

    got, expected = everything(*resumed), everything(*never_stopped)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (a, b)


def test_the_tree_keeps_types_and_exact_floats():
    class Holder:
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.loaded = state

    state = {0: {"step": torch.tensor(3.0), "m": torch.arange(4, dtype=torch.float64)},
             "groups": [{"lr": 0.1 + 0.2, "betas": (0.9, 0.999), "nesterov": False,
                         "name": "x", "none": None, "inf": float("inf"),
                         "scalar": np.float32(0.5)}]}
    holder = Holder(state)
    arrays = torch_state.state_arrays(holder, "h")
    torch_state.load_state_arrays(holder, arrays, "h")
    loaded = holder.loaded
    assert list(loaded) == [0, "groups"]
    assert torch.equal(loaded[0]["m"], state[0]["m"]) and loaded[0]["m"].dtype == torch.float64
    assert loaded[0]["step"].dtype == torch.float32
    assert loaded["groups"][0] == state["groups"][0]
    assert type(loaded["groups"][0]["betas"]) is tuple
    assert type(loaded["groups"][0]["scalar"]) is np.float32


def test_what_cannot_be_saved_without_pickle_is_refused_by_name():
    class Holder:
        def state_dict(self):
            return {"lr_lambdas": [lambda step: step]}

    with pytest.raises(TypeError, match=r"state_dict\(\)\['lr_lambdas'\]\[0\] = .*function"):
        torch_state.state_arrays(Holder(), "h")
    with pytest.raises(KeyError, match="no torch state saved under 'x'.*'h'"):
        torch_state.load_state_arrays(Holder(), {"h/tree": np.array("{}")}, "x")


@pytest.mark.parametrize("thing", [5, object(), torch.nn.Linear(2, 2).weight])
def test_an_object_without_a_state_dict_is_a_type_error(thing):
    """Before: AttributeError: 'int' object has no attribute 'state_dict'."""
    with pytest.raises(TypeError, match=r"torch optimizer or learning-rate scheduler .*"
                                        r"state_dict\(\)"):
        torch_state.state_arrays(thing, "o")
    with pytest.raises(TypeError, match=r"load_state_dict\(\)"):
        torch_state.load_state_arrays(thing, {"o/tree": np.array("{}")}, "o")
