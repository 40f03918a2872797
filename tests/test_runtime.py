"""RoundPipe numerics: sync steps against plain PyTorch, masters, OptimizerCtx, forward, configs."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, optim_thread


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.GELU(), nn.Linear(12, 3)
    ).to(dtype)


def data(seed=1, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def loss_fn(out, y):
    return F.cross_entropy(out.float(), y, reduction="sum") / 8


def plain_accumulate(model, x, y, M):
    total = 0.0
    for xm, ym in zip(torch.tensor_split(x, M), torch.tensor_split(y, M)):
        loss = loss_fn(model(xm), ym)
        loss.backward()
        total += loss.item()
    return total


@pytest.mark.parametrize("devices,recompute", [("cpu", True), ("cpu:2", True), ("cpu:3", False)])
def test_sync_step_equals_plain_gradient_accumulation(devices, recompute):
    ref = mlp()
    model = RoundPipe(
        mlp(),
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=4, recompute=recompute),
    )
    with OptimizerCtx():
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for it in range(4):
        x, y = data(it)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref_loss = plain_accumulate(ref, x, y, 4)
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    for (n, p), (rn, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == rn
        torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            dict(model.optim_named_parameters())[n], rp, rtol=1e-5, atol=1e-6
        )


def test_grads_accumulate_in_optim_dtype_on_masters():
    model = RoundPipe(
        mlp(dtype=torch.bfloat16),
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
    )
    ref = mlp(dtype=torch.bfloat16)
    x, y = data()
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    expected = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
    for xm, ym in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
        grads = torch.autograd.grad(loss_fn(ref(xm.bfloat16()), ym), list(ref.parameters()))
        for (n, _), g in zip(ref.named_parameters(), grads):
            assert g.dtype == torch.bfloat16
            expected[n] += g.float()  # the fp32 sum of bf16 microbatch grads
    for n, master in model.optim_named_parameters():
        assert master.dtype == torch.float32 and master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, expected[n], rtol=0, atol=0)
    for p in model.module.parameters():
        assert p.dtype == torch.bfloat16 and p.grad is None


def test_optimizer_ctx_and_names():
    model = RoundPipe(mlp(dtype=torch.float16), devices="cpu")
    outside = dict(model.named_parameters())
    with OptimizerCtx():
        inside = dict(model.named_parameters())
        params = model.parameters()
    assert list(outside) == list(inside) == list(model.state_dict())
    assert all(p.dtype == torch.float16 for p in outside.values())
    assert all(p.dtype == torch.float32 and p.is_leaf for p in inside.values())
    assert [id(p) for p in params] == [id(p) for _, p in model.optim_named_parameters()]
    seen = []
    x, y = data()
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(lambda: seen.append({p.dtype for p in model.parameters()}), is_async=False)
    assert seen == [{torch.float32}]
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_frozen_params_get_no_master_and_optim_dtype_is_honoured():
    seq = mlp()
    seq[0].weight.requires_grad_(False)
    model = RoundPipe(seq, optim_dtype=torch.float64)
    names = [n for n, _ in model.optim_named_parameters()]
    assert "0.weight" not in names and "0.bias" in names
    assert {m.dtype for m in model.optim_parameters()} == {torch.float64}


def test_forward_is_microbatched_inference():
    ref = mlp()
    model = RoundPipe(mlp(), devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x, _ = data(n=7)
    with torch.no_grad():
        out = model(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)


def test_forward_takes_a_per_call_run_config():
    model = RoundPipe(mlp(), model_run_config=RoundPipeRunConfig(num_microbatch=4))
    x, _ = data(n=2)
    with torch.no_grad():
        with pytest.raises(ValueError, match="cannot be split into 4 microbatches"):
            model(x)
        out = model(x, run_config=RoundPipeRunConfig(num_microbatch=1))
    torch.testing.assert_close(out, mlp()(x), rtol=1e-6, atol=1e-6)


def test_fp32_input_is_cast_to_the_low_precision_model():
    model = RoundPipe(mlp(dtype=torch.bfloat16))
    x, _ = data()
    with torch.no_grad():
        out = model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, mlp(dtype=torch.bfloat16)(x.bfloat16()), rtol=0, atol=0)


def test_differentiable_forward_moves_grads_into_masters():
    ref = mlp()
    model = RoundPipe(mlp(), devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = data()
    out = model(x)
    assert out.requires_grad
    loss_fn(out, y).backward()
    loss_fn(ref(x), y).backward()
    optim_thread.synchronize()
    for (_n, master), (_, rp) in zip(model.optim_named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(master.grad, rp.grad, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model.module.parameters())
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.step(lambda: opt.step(), is_async=False)


def test_return_outputs_and_call_config_beats_model_config():
    ref = mlp()
    model = RoundPipe(mlp(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = data()
    calls = []

    def counting_loss(out, lbl):
        calls.append(out.shape[0])
        return loss_fn(out, lbl)

    loss, out = model.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=counting_loss,
        return_outputs=True,
        run_config=RoundPipeRunConfig(num_microbatch=4),
    )
    assert calls == [2, 2, 2, 2]  # loss_fn once per microbatch
    assert not out.requires_grad and out.shape == (8, 3)
    torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)
    assert loss.dim() == 0 and not loss.requires_grad
    calls.clear()
    model.forward_backward(input_args=(x,), label=y, loss_fn=counting_loss)
    assert calls == [4, 4]


def test_execute_plan_partition_gives_same_result():
    x, y = data()
    grads = []
    for plan in (None, [2, 3], [5]):
        model = RoundPipe(
            mlp(),
            devices="cpu:2",
            model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
        )
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        grads.append([m.grad for m in model.optim_parameters()])
        assert len(model.plan().per_device[0]) > 0
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:RoundPipe runs a Net:UserWarning")
def test_non_sequential_module_is_one_layer_and_kwargs_pass_through():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x, scale=1.0):
            return self.lin(x) * scale

    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = data()
    model.forward_backward(input_args=(x,), input_kwargs={"scale": 2.0}, label=y, loss_fn=loss_fn)
    loss_fn(ref(x, scale=2.0), y).backward()
    torch.testing.assert_close(
        dict(model.optim_named_parameters())["lin.weight"].grad,
        ref.lin.weight.grad,
        rtol=1e-5,
        atol=1e-6,
    )


class Scaled(nn.Linear):
    def forward(self, x, scale=1.0):
        return super().forward(x) * scale


@pytest.mark.parametrize("devices", ["cpu", "cpu:2"])
def test_call_arguments_reach_the_first_layer_only(devices):
    """docs/microbatch.md: the call's arguments go to the first layer; every later layer gets the
    previous layer's output alone (so its keyword arguments keep their defaults)."""
    torch.manual_seed(0)
    seq = nn.Sequential(Scaled(6, 6), Scaled(6, 3))
    model = RoundPipe(seq, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = data()
    with torch.no_grad():
        first_only = seq[1](seq[0](x, scale=3.0))
        everywhere = seq[1](seq[0](x, scale=3.0), scale=3.0)
        out = model(x, scale=3.0)
    torch.testing.assert_close(out, first_only)
    assert not torch.allclose(out, everywhere)
    # forward_backward: the same routing, so the same loss as the first-only reference.
    loss = model.forward_backward(
        input_args=(x,), input_kwargs={"scale": 3.0}, label=y, loss_fn=loss_fn
    )
    torch.testing.assert_close(loss, loss_fn(first_only, y))


def test_synchronize_copies_newest_masters_and_state_dict_keys():
    model = RoundPipe(mlp(dtype=torch.bfloat16), devices="cpu:2")
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = data()
    for _ in range(3):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()))
    w = model.module[0].weight
    master = dict(model.optim_named_parameters())["0.weight"]
    optim_thread.synchronize()
    assert not torch.equal(w, master.to(torch.bfloat16))  # async: the model is a step behind
    model.synchronize()
    assert torch.equal(w, master.to(torch.bfloat16)) and w is model.module[0].weight
    assert list(model.state_dict()) == list(mlp().state_dict())


@pytest.mark.parametrize(
    "change",
    ["missing", "unexpected", "shape", "not a tensor"],
)
def test_a_refused_load_state_dict_changes_nothing(change):
    # It used to copy the tensors that matched into the model (not into the masters), then
    # raise: a refused load must leave the model and its masters as they were.
    model = RoundPipe(mlp(dtype=torch.bfloat16), devices="cpu:2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    masters = model.master_state_dict()
    bad = {k: torch.full_like(v, 7.0) for k, v in before.items()}
    if change == "missing":
        del bad["4.bias"]
    elif change == "unexpected":
        bad["9.weight"] = torch.zeros(1)
    elif change == "shape":
        bad["4.bias"] = torch.zeros(4, dtype=torch.bfloat16)
    else:
        bad["4.bias"] = [0.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="nothing was loaded") as info:
        model.load_state_dict(bad)
    assert "4.bias" in str(info.value) or "9.weight" in str(info.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in model.master_state_dict().items():
        assert torch.equal(v, masters[k]), k
    if change in ("missing", "unexpected"):  # not strict: the rest loads, masters follow
        model.load_state_dict(bad, strict=False)
        assert torch.equal(model.module[0].weight, bad["0.weight"])
        assert torch.equal(model.master_state_dict()["0.weight"], bad["0.weight"].float())


def test_design_loop_runs_with_roundpipe_scaler_and_adam():
    torch.manual_seed(0)
    seq_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = RoundPipe(
        seq_model.half(),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
        devices="cpu:2",
    )
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler()
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 8, generator=g)
    Y = (X[:, 0] > 0).long() + 2 * (X[:, 1] > 0).long()
    loader = [(X[i : i + 16], Y[i : i + 16]) for i in range(0, 64, 16)] * 8
    losses = []
    for x, y in loader:
        scale = scaler.get_scale()
        loss = model.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=lambda out, lbl: scaler.scale(F.cross_entropy(out.float(), lbl)) / 4,
        )
        losses.append(loss.item() / scale)
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
    model.synchronize()
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4])
    for n, master in model.optim_named_parameters():
        assert torch.equal(dict(model.named_parameters())[n], master.half())


def test_two_calls_before_a_step_accumulate():
    ref = mlp()
    model = RoundPipe(mlp(), devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for it in range(2):
        x, y = data(it)
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        plain_accumulate(ref, x, y, 2)
    model.step(lambda: opt.step(), is_async=False)
    ref_opt.step()
    for (_n, master), (_, rp) in zip(model.optim_named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(master.grad, rp.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(master, rp, rtol=1e-5, atol=1e-6)


class AddParams(nn.Module):
    """Backward hands the same grad_output tensor to the input and to both parameters."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(4, 3))
        self.q = nn.Parameter(torch.zeros(4, 3))

    def forward(self, x):
        return x + self.p + self.q


@pytest.mark.parametrize("devices", ["cpu", "cpu:2"])
def test_aliased_gradients_are_not_shared_between_masters(devices):
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(3, 3), AddParams(), nn.Linear(3, 1))
    ref = copy.deepcopy(seq)
    model = RoundPipe(seq, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x = torch.randn(8, 3)
    model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum())
    for xm in x.chunk(2):
        ref(xm).sum().backward()
    for (n, master), (_, rp) in zip(model.optim_named_parameters(), ref.named_parameters()):
        assert torch.equal(master.grad, rp.grad), n


class _OneStorageGrads(torch.autograd.Function):
    """x + p + q whose backward hands p and q two views of one fresh storage."""

    @staticmethod
    def forward(ctx, x, p, q):
        return x + p + q

    @staticmethod
    def backward(ctx, g):
        shared = g.sum(0).clone()
        return g, shared.view(-1), shared.view(-1)


class _OneStorageParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(3))
        self.q = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return _OneStorageGrads.apply(x, self.p, self.q)


def test_gradients_given_as_views_of_one_storage_stay_separate_and_equal_on_any_worker_count():
    x = torch.randn(9, 3)
    grads = {}
    for devices in ("cpu", "cpu:2"):
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Linear(3, 3), _OneStorageParams(), nn.Linear(3, 1))
        model = RoundPipe(
            seq, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3)
        )
        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.pow(2).sum())
        grads[devices] = {n: m.grad.clone() for n, m in model.optim_named_parameters()}
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 3), _OneStorageParams(), nn.Linear(3, 1))
    names, params = zip(*ref.named_parameters())
    # Summed by hand: .backward() itself would let p.grad and q.grad share the storage.
    per_mb = [torch.autograd.grad(ref(xm).pow(2).sum(), params) for xm in torch.tensor_split(x, 3)]
    for n, *gs in zip(names, *per_mb):
        assert torch.equal(grads["cpu"][n], grads["cpu:2"][n]), n
        torch.testing.assert_close(grads["cpu"][n], sum(gs), rtol=1e-6, atol=1e-6)


@pytest.mark.cpu_pool_only  # an accelerator streams stage by stage instead (test_streaming.py)
def test_one_device_fuses_the_stages_of_a_microbatch_unless_a_parameter_spans_stages():
    cfg = RoundPipeRunConfig(num_microbatch=3)
    fused = RoundPipe(mlp(), devices="cpu", model_run_config=cfg)
    assert {a.kind for a in fused.plan().actions()} == {roundpipe.plan.ActionKind.MICROBATCH}
    assert len(fused.plan().actions()) == 3
    # Inference and several devices keep per-stage actions; so do tied weights (one backward
    # would sum a shared weight's two gradients in another order than the per-stage plan).
    assert len(fused.plan(training=False).actions()) == 5 * 3
    assert len(RoundPipe(mlp(), devices="cpu:2", model_run_config=cfg).plan().actions()) > 3
    tied = RoundPipe(_tied(), devices="cpu", model_run_config=cfg)
    assert roundpipe.plan.ActionKind.BACKWARD in {a.kind for a in tied.plan().actions()}


def test_a_grad_left_on_a_model_parameter_is_not_added_and_is_left_in_place():
    # One device accumulates through the model params' .grad (see [Note: fused stages]).
    x, y = data()
    grads = {}
    for devices in ("cpu", "cpu:2"):
        seq = mlp()
        seq(x).sum().backward()  # a plain backward before wrapping leaves .grad behind
        left = [p.grad.clone() for p in seq.parameters()]
        model = RoundPipe(
            seq, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        grads[devices] = [m.grad for m in model.optim_parameters()]
        assert all(torch.equal(p.grad, g) for p, g in zip(seq.parameters(), left))
    assert all(torch.equal(a, b) for a, b in zip(grads["cpu"], grads["cpu:2"]))


@pytest.mark.parametrize("devices", ["cpu", "cpu:2"])
def test_batchnorm_running_stats_are_updated_once_per_microbatch_with_recompute(devices):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model = RoundPipe(
        copy.deepcopy(ref), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    x = torch.randn(8, 4)
    model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum())
    for xm in torch.tensor_split(x, 2):
        ref(xm).sum().backward()
    bn, ref_bn = model.module[1], ref[1]
    assert bn.num_batches_tracked.item() == ref_bn.num_batches_tracked.item() == 2
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=0, atol=1e-7)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=0, atol=1e-7)


def test_backward_through_forward_returns_with_the_gradients_in_the_masters():
    torch.manual_seed(0)
    model = RoundPipe(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)))
    out = model(torch.randn(16, 64))
    out.pow(2).mean().backward()
    # No wait, no synchronize: backward() itself handed the gradients over.
    assert all(m.grad is not None for m in model.optim_parameters())
    assert all(p.grad is None for p in model.module.parameters())


def test_a_module_wrapped_again_sends_its_gradients_to_the_new_masters():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    old = RoundPipe(seq)
    old(torch.randn(2, 4)).sum().backward()
    optim_thread.synchronize()
    for m in old.optim_parameters():
        m.grad = None
    new = RoundPipe(seq)
    new(torch.randn(2, 4)).sum().backward()
    assert all(m.grad is not None for m in new.optim_parameters())
    assert all(m.grad is None for m in old.optim_parameters())


@pytest.mark.parametrize("devices,recompute", [("cpu", True), ("cpu:2", True), ("cpu:3", False)])
def test_inputs_that_require_grad_get_their_gradients_through_the_callers_graph(devices, recompute):
    # An embedding outside the RoundPipe feeds it: forward_backward must reach the embedding's
    # weight through the input, as loss.backward() over the whole graph would.
    torch.manual_seed(0)
    emb = nn.Embedding(10, 6)
    ref_emb = copy.deepcopy(emb)
    ref = mlp()
    model = RoundPipe(
        mlp(),
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=4, recompute=recompute),
    )
    tokens = torch.randint(0, 10, (8,))
    x, _ = data()
    x.requires_grad_()
    y = torch.randint(0, 3, (8,))
    model.forward_backward(input_args=(emb(tokens) + x,), label=y, loss_fn=loss_fn)
    ref_x = x.detach().clone().requires_grad_()
    h = ref_emb(tokens) + ref_x
    for hm, ym in zip(torch.tensor_split(h, 4), torch.tensor_split(y, 4)):
        loss_fn(ref(hm), ym).backward(retain_graph=True)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(emb.weight.grad, ref_emb.weight.grad, rtol=1e-5, atol=1e-7)
    for (_n, master), (_, p) in zip(model.optim_named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(master.grad, p.grad, rtol=1e-5, atol=1e-7)


def test_input_gradients_of_a_low_precision_model_arrive_in_the_inputs_dtype():
    model = RoundPipe(
        mlp(dtype=torch.bfloat16),
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    x, y = data()
    x.requires_grad_()
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert x.grad.abs().sum() > 0


def test_inputs_without_requires_grad_get_no_gradient():
    model = RoundPipe(mlp(), devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = data()
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    assert x.grad is None and not x.requires_grad


class _TiedIn(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        return x @ self.w


class _TiedOut(_TiedIn):
    def forward(self, x):
        return x @ self.w.t()


def _tied(seed=0):
    torch.manual_seed(seed)
    w = nn.Parameter(torch.randn(6, 6) / 3)
    return nn.Sequential(_TiedIn(w), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), _TiedOut(w))


def test_a_parameter_shared_by_first_and_last_stage_is_bitwise_the_same_on_any_worker_count():
    # Each stage sums its own microbatches; the last stage's sum reaches the master first,
    # since stage 0's last backward depends on it: the order does not depend on the workers.
    x, _ = data(n=12)
    grads = {}
    for devices in ("cpu", "cpu:2", "cpu:3"):
        model = RoundPipe(
            _tied(), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3)
        )
        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.pow(2).sum())
        grads[devices] = [m.grad.clone() for m in model.optim_parameters()]
    assert len(grads["cpu"]) == 5  # the shared weight has one master
    for devices in ("cpu:2", "cpu:3"):
        assert all(torch.equal(a, b) for a, b in zip(grads["cpu"], grads[devices]))
    ref = _tied()
    for xm in torch.tensor_split(x, 3):
        ref(xm).pow(2).sum().backward()
    torch.testing.assert_close(grads["cpu"][0], ref[0].w.grad, rtol=1e-5, atol=1e-6)


def test_a_resolved_run_config_has_no_optional_field():
    import typing

    from roundpipe.runtime.config import ResolvedRunConfig, resolve_config

    hints = typing.get_type_hints(ResolvedRunConfig)
    optional = [
        name
        for name, hint in hints.items()
        if type(None) in typing.get_args(hint) or hint is type(None)
    ]
    assert optional == []
    cfg = resolve_config(
        RoundPipeRunConfig(num_microbatch=2), RoundPipeRunConfig(recompute=False), num_layers=3
    )
    assert cfg.num_microbatch == 2 and cfg.recompute is False
    assert cfg.execute_plan == ((0, 1), (1, 2), (2, 3))
    assert cfg.autocast == "caller" and cfg.device_memory_budget == "none"


def _train_and_drop(seq, devices, directory):
    """Train a RoundPipe of ``seq`` with its state in files under ``directory``; return a
    weak reference to it, and nothing else of it."""
    placement = roundpipe.MastersOnDisk(directory)
    model = RoundPipe(seq, optim_dtype=torch.float32, devices=devices, state_placement=placement)
    opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-3, state_dir=directory)
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    for _ in range(2):
        model.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda o, lbl: F.cross_entropy(o.float(), lbl)
        )
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    assert len(list(directory.iterdir())) == 2  # the masters' and Adam's directories
    return weakref.ref(model)


@pytest.mark.parametrize("devices", ["cpu", "cpu:2", "emu"])
def test_a_trained_model_is_collected_once_dropped(devices, tmp_path):
    # Its gradient hooks live on the C++ side of the wrapped module's parameters, out of the
    # collector's sight: they must not keep the model, its masters and their files alive.
    seq = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).half()
    gone = _train_and_drop(seq, devices, tmp_path)
    gc.collect()
    assert gone() is None
    assert list(tmp_path.iterdir()) == []  # both removed with their owners
    # The module trains as a plain module again: its hooks found their model gone.
    seq.float()(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in seq.parameters())
