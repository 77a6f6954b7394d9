"""The swap of fast implementations (depthbench.kernels.swap): the architectures stay their
definitions and know nothing of kernels or devices; swapping in and out changes classes only;
`train.kernels` and DEPTHBENCH_KERNELS choose; and the probes, layer removal and the logit lens
read the same numbers from a swapped model as from its definition."""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import torch

from depthbench import kernels
from depthbench.kernels import attnres_triton, triton_streams
from depthbench.kernels.swap import backend_for, resolve_kernels, swap_in, swap_out, swapped
from depthbench.models.adapter import trunk_states
from depthbench.probes.measure import probe_model
from depthbench.probes.removal import ScoredTokens, loss_without
from depthbench.probes.run import probe_settings
from depthbench.util.errors import ConfigError
from tests.unit.test_logit_lens import perturbed, sample

ARCHS_DIR = Path(__file__).resolve().parents[2] / "depthbench" / "models" / "archs"
DEVICE_NAMES = {"cpu", "cuda", "meta", "mps", "xpu"}


def _device_questions(tree: ast.AST) -> list[str]:
    """Where code asks which device or kernels it runs on: an import of depthbench.kernels,
    `x.device.type`, `x.is_cuda`, `torch.cuda`, a device name as a string constant outside a
    docstring."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "depthbench.kernels"
        ):
            found.append(f"line {node.lineno}: from {node.module} import")
        elif isinstance(node, ast.ImportFrom) and node.module == "depthbench":
            if any(alias.name == "kernels" for alias in node.names):
                found.append(f"line {node.lineno}: from depthbench import kernels")
        elif isinstance(node, ast.Import) and any(
            a.name.startswith("depthbench.kernels") for a in node.names
        ):
            found.append(f"line {node.lineno}: import depthbench.kernels")
        elif isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            found.append(f"line {node.lineno}: .is_cuda")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "type"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "device"
        ):
            found.append(f"line {node.lineno}: .device.type")
        elif isinstance(node, ast.Attribute) and node.attr == "cuda":
            found.append(f"line {node.lineno}: .cuda")
        elif (
            isinstance(node, ast.Constant)
            and node.value in DEVICE_NAMES
            and id(node) not in docstrings
        ):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_no_architecture_module_imports_kernels_or_asks_for_a_device():
    offences = {
        path.name: questions
        for path in sorted(ARCHS_DIR.glob("*.py"))
        if (questions := _device_questions(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert offences == {}


def test_the_check_finds_what_it_looks_for():
    """The scan above catches each kind of question (a control)."""
    code = (
        "from depthbench import kernels\n"
        "from depthbench.kernels.swap import swap_in\n"
        "def f(x):\n"
        '    """on the cpu"""\n'
        "    if x.device.type == 'cpu' or x.is_cuda or torch.cuda.is_available():\n"
        "        return x\n"
    )
    found = _device_questions(ast.parse(code))
    assert len(found) == 6 and not any("on the cpu" in f for f in found), found


def test_swapping_changes_classes_only_and_is_undone():
    model = perturbed("mhc")
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    swap_in(model, "cuda")
    swap_in(model, "cuda")  # idempotent
    assert set(swapped(model).values()) == {"TritonManifoldHyperConnection"}
    assert len(swapped(model)) == 2 * model.cfg.n_layer
    assert [name for name, _ in model.named_parameters()] == names
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    swap_in(model, "cpu")  # another backend replaces the first
    assert set(swapped(model).values()) == {"CpuManifoldHyperConnection"}
    assert [type(m) for m in swap_out(model).modules()] == classes
    assert swapped(swap_in(model, "cpu", "reference")) == {}
    assert swapped(swap_in(model.to("meta"), "meta")) == {}  # no backend for meta


def test_settings_and_the_environment_switch(monkeypatch):
    monkeypatch.delenv("DEPTHBENCH_KERNELS", raising=False)
    assert resolve_kernels("auto") == "auto" and resolve_kernels("reference") == "reference"
    with pytest.raises(ConfigError, match="train.kernels"):
        resolve_kernels("triton")
    monkeypatch.setenv("DEPTHBENCH_KERNELS", "reference")
    assert resolve_kernels("auto") == "reference"
    assert swapped(swap_in(perturbed("hc"), "cpu")) == {}
    monkeypatch.setenv("DEPTHBENCH_KERNELS", "fast")
    with pytest.raises(ConfigError, match="DEPTHBENCH_KERNELS"):
        resolve_kernels("auto")
    assert backend_for("cuda:1") == "cuda" and backend_for("mps") is None


def test_a_run_with_train_kernels_reference_trains_the_definition(tiny_data, tmp_path, monkeypatch):
    """Through the trainer: `train.kernels: auto` trains HC with the CPU's kernels swapped in,
    `reference` with the definition, to the same weights (1e-5); the schema refuses another
    value."""
    import dataclasses

    from safetensors.torch import load_file

    from conftest import tiny_config
    from depthbench.spec.schema import load_config
    from depthbench.train import parallelize
    from depthbench.train.loop import train
    from depthbench.train.recipe import RunPaths

    seen = []

    def spy(model, device, setting):
        swap_in(model, device, setting)
        seen.append((setting, sorted(set(swapped(model).values()))))
        return model

    monkeypatch.setattr(parallelize, "swap_in", spy)
    _, exp, data_dir = tiny_data
    spec = next(iter(exp.runs.values()))
    weights = {}
    for setting in ("auto", "reference"):
        run = dataclasses.replace(
            spec,
            model=dataclasses.replace(spec.model, arch="hc"),
            train=dataclasses.replace(spec.train, kernels=setting),
        )
        paths = RunPaths(tmp_path / setting / "run", tmp_path / setting / "work")
        assert train(run, data_dir, paths, progress=False)["status"] == "ok"
        weights[setting] = load_file(paths.weights)
    built = kernels.unavailable_reason() is None
    assert seen == [("auto", ["CpuHyperConnection"] if built else []), ("reference", [])]
    for name, w in weights["reference"].items():
        torch.testing.assert_close(weights["auto"][name], w, rtol=1e-5, atol=1e-5, msg=name)
    config = tiny_config(tmp_path / "corpus.jsonl")
    config["train"]["kernels"] = "triton"
    with pytest.raises(ConfigError, match="kernels"):
        load_config(config)


PROBED = [
    ("hc", "cpu"),
    ("mhc", "cpu"),
    ("moda", "cpu"),
    ("moda", "cuda"),
    ("attnres_full", "cuda"),
    ("attnres_block", "cuda"),
    ("attnres_full", "cuda-interpreted"),  # the Triton products, in the interpreter
    ("attnres_block", "cuda-interpreted"),
]


@pytest.mark.parametrize("arch, backend", PROBED, ids=[f"{a}-{b}" for a, b in PROBED])
def test_probes_removal_and_lens_read_the_same_numbers(arch, backend, monkeypatch):
    """Every probe row (angular distances, causal and permutation scores, usefulness, the logit
    lens, the stream-mixing rank or depth weights) and the layer-removal losses of a swapped
    model equal its definition's."""
    if backend == "cpu" and arch in ("hc", "mhc") and kernels.unavailable_reason() is not None:
        pytest.skip(f"CPU kernels cannot be built here: {kernels.unavailable_reason()}")
    interpreted = backend == "cuda-interpreted"  # CPU tensors take the Triton kernels
    if interpreted and (torch.cuda.is_available() or importlib.util.find_spec("triton") is None):
        pytest.skip("the Triton interpreter runs on a CPU-only machine with triton")
    calls = []
    mix = attnres_triton.attnres_mix
    monkeypatch.setattr(attnres_triton, "attnres_mix", lambda *a: calls.append(1) or mix(*a))
    definition = perturbed(arch, n_layer=3)
    fast = swap_in(copy.deepcopy(definition), "cuda" if interpreted else backend)
    assert swapped(fast)
    with triton_streams.on_cpu() if interpreted else contextlib.nullcontext():
        _same_numbers(fast, definition)
    assert bool(calls) == interpreted


def _same_numbers(fast, definition):
    idx, settings = sample(), probe_settings({"bootstrap_seed": 0})
    with torch.no_grad():
        rows = [
            pd.DataFrame(probe_model(m, idx, "trained", settings, full=True))
            for m in (fast, definition)
        ]
    keys = ["probe", "stage", "i", "j"]
    got, want = (df.sort_values(keys).reset_index(drop=True) for df in rows)
    pd.testing.assert_frame_equal(got[keys], want[keys])
    assert len(got) > 50 and set(got["probe"]) >= {"angular_distance_all", "lens_cross_entropy"}
    # an angular distance near 0 is arccos of a cosine near 1, which turns float32 rounding
    # (1e-7) into about sqrt(2e-7) / pi = 1.4e-4: those rows get that much room
    angular = got["probe"].str.startswith("angular_distance").to_numpy()
    for column in ("value", "ci_low", "ci_high"):
        a, b = (torch.tensor(df[column].to_numpy(dtype=float).copy()) for df in (got, want))
        for rows, atol in ((torch.tensor(angular), 3e-4), (torch.tensor(~angular), 1e-5)):
            torch.testing.assert_close(
                a[rows], b[rows], rtol=1e-4, atol=atol, equal_nan=True, msg=column
            )
    scored = ScoredTokens.windows(sample(n=2, t=11, seed=2))
    with torch.no_grad():
        for removed in ([], [2], [1, 3]):
            losses = [
                loss_without(m, trunk_states(m, scored.inputs), scored, removed)
                for m in (fast, definition)
            ]
            assert losses[0] == pytest.approx(losses[1], rel=1e-5), removed
