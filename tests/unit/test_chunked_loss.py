"""The chunked LM head + cross-entropy (depthbench.models.loss): the plain fp32 loss and its
gradients, without the (N, V) logits among the tensors kept for backward."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.models.loss import chunked_cross_entropy


def _plain(x, w, y):
    return F.cross_entropy((x @ w.t()).float().reshape(-1, w.shape[0]), y.reshape(-1))


def _loss_and_grads(fn, x, w, y):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(x, w, y)
    loss.backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 16, 50, 1000])
def test_chunked_loss_and_gradients_equal_the_plain_loss(chunk):
    torch.manual_seed(0)
    x, w = torch.randn(3, 37, 32), torch.randn(97, 32) * 0.3
    y = torch.randint(0, 97, (3, 37))
    y[0, :5] = -100  # ignored targets count neither in the sum nor in the mean
    ref = _loss_and_grads(_plain, x, w, y)
    got = _loss_and_grads(lambda a, b, t: chunked_cross_entropy(a, b, t, chunk) * 1.0, x, w, y)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-6
    with torch.no_grad():  # evaluation: the loss alone
        assert (chunked_cross_entropy(x, w, y, chunk) - ref[0]).abs() <= 1e-6


def test_the_incoming_gradient_scales_both_gradients():
    torch.manual_seed(1)
    x, w, y = torch.randn(40, 16), torch.randn(50, 16), torch.randint(0, 50, (40,))
    ref = _loss_and_grads(lambda a, b, t: 0.25 * _plain(a, b, t), x, w, y)
    got = _loss_and_grads(lambda a, b, t: 0.25 * chunked_cross_entropy(a, b, t, 7), x, w, y)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() <= 1e-6


def _saved_bytes(fn) -> int:
    seen, total = set(), [0]

    def pack(t):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def test_chunked_loss_keeps_no_logits_for_backward():
    N, d, V = 512, 32, 2048
    torch.manual_seed(0)
    x, w = torch.randn(N, d, requires_grad=True), torch.randn(V, d, requires_grad=True)
    y = torch.randint(0, V, (N,))
    plain = _saved_bytes(lambda: _plain(x, w, y))
    chunked = _saved_bytes(lambda: chunked_cross_entropy(x, w, y, 64))
    assert plain >= N * V * 4  # at least the fp32 log-probabilities of every token
    assert (
        chunked <= (N * d + V * d) * 4
    )  # the two gradients (d x, d W), nothing per vocabulary entry and token


def _model(chunk):
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(arch="pre_ln", vocab_size=97, d_model=32, n_layer=2, n_head=2, max_seq_len=16)
    )
    model.loss_chunk_tokens = chunk
    return model


def test_the_model_loss_in_chunks_equals_the_plain_loss():
    idx = torch.randint(0, 97, (3, 16))
    results = []
    for chunk in (0, 20):
        model = _model(chunk)
        out = model(idx, idx)
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (plain, g_plain), (chunked, g_chunked) = results
    assert plain.logits is not None and chunked.logits is None  # chunked: no (N, V) logits at all
    assert (plain.loss - chunked.loss).abs() <= 1e-6
    assert all((g_plain[n] - g_chunked[n]).abs().max() <= 1e-6 for n in g_plain)
    assert _model(20)(idx).logits.shape == (3, 16, 97)  # without targets: logits as always


def test_training_with_the_knob_gives_the_plain_curve(tiny_data, tmp_path):
    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train

    _, exp, data_dir = tiny_data
    curves = []
    for chunk in (0, 48):  # 48 < 4 x 32 tokens per micro-batch: three chunks, the last one shorter
        spec = copy.deepcopy(next(iter(exp.runs.values())))
        spec.train.total_steps, spec.train.log_every, spec.train.loss_chunk_tokens = 3, 1, chunk
        train(
            spec, data_dir, RunPaths(tmp_path / str(chunk), tmp_path / f"w{chunk}"), progress=False
        )
        lines = [
            json.loads(line)
            for line in (tmp_path / str(chunk) / "metrics.jsonl").read_text().splitlines()
        ]
        curves.append([r["train_loss"] for r in lines if "train_loss" in r])
    assert len(curves[0]) == 3 and curves[0] == pytest.approx(curves[1], abs=1e-5)


def test_the_knob_default_is_the_schema_default():
    import yaml

    from depthbench.spec.training import TrainConfig
    from tests.conftest import REPO

    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert (
        schema["properties"]["train"]["properties"]["loss_chunk_tokens"]["default"]
        == TrainConfig().loss_chunk_tokens
        > 0
    )
    assert "loss_chunk_tokens" in TrainConfig.NOT_HASHED


def test_chunked_loss_traces_on_the_meta_device():
    """The memory estimate traces the model on meta (depthbench.train.activation_trace), where
    torch.autocast refuses the device: the chunked loss turns autocast off through
    kernels.precision, which on meta pauses the replayed casts instead."""
    from depthbench.models import precision

    x = torch.empty(2, 8, 16, device="meta", requires_grad=True)
    w = torch.empty(32, 16, device="meta", requires_grad=True)
    y = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with precision.replaying(precision.Replay(device="cpu", enabled=True)):
        loss = chunked_cross_entropy(x, w, y, 5)
    assert loss.is_meta and loss.shape == ()
