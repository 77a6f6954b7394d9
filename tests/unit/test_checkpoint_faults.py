"""Checkpoints that are crafted, damaged or incomplete: none executes code or is loaded, the newest
good one is, with a report naming each one skipped, and a run resumes past a damaged one with the
weights of a run never stopped. A checkpoint write killed part-way:
tests/integration/test_checkpoint_kill.py."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from depthbench.train.checkpoint import load_latest
from depthbench.train.checkpoint_folder import checksum_path, list_checkpoints
from tests.conftest import REPO
from tests.run_outputs import load_newest, save_step


def _reseal(path: Path) -> None:
    """Rewrite the manifest's sha256 entries and its checksum to match the files as they are now:
    what someone who crafts a checkpoint can do."""
    manifest = json.loads((path / "state.json").read_text())
    manifest["files"] = {
        name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in manifest["files"]
    }
    (path / "state.json").write_text(json.dumps(manifest))
    digest = hashlib.sha256((path / "state.json").read_bytes()).hexdigest()
    checksum_path(path).write_text(f"{digest}  state.json\n")


def _saved(folder: Path, steps=(1, 2)) -> list[Path]:
    return [save_step(folder, s) for s in steps]


class _Payload:  # what a crafted checkpoint carries: a call run by the unpickler
    marker = None

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled"
)  # the crafted save: one process, as meant
@pytest.mark.parametrize("where", ["metadata", "object_entry"])
def test_checkpoint_that_would_execute_code_is_refused_and_the_previous_is_used(
    tmp_path, capsys, where
):
    import pickle

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "executed"
    _Payload.marker = marker
    good, bad = _saved(tmp_path / "ck", (1, 2))
    if where == "metadata":  # DCP's .metadata is a pickle: a payload in place of the metadata
        (bad / ".metadata").write_bytes(pickle.dumps(_Payload()))
    else:  # a genuine DCP checkpoint whose entry is an object, which DCP loads with
        # torch.load(weights_only=False)
        shutil.rmtree(bad)
        dcp.save({"model": {"w": _Payload()}}, checkpoint_id=str(bad), no_dist=True)
        for name in ("state.json", "state.json.sha256", "rank_0.safetensors"):
            shutil.copy(good / name, bad / name)
        manifest = json.loads((bad / "state.json").read_text())
        manifest["step"], manifest["files"] = (
            2,
            {
                n: "0" * 64
                for n in os.listdir(bad)
                if n.endswith((".distcp", ".metadata", ".safetensors"))
            },
        )
        (bad / "state.json").write_text(json.dumps(manifest))
    _reseal(bad)  # even matching checksums (an attacker can write them) do not make it loadable
    step, w = load_newest(tmp_path / "ck")
    assert not marker.exists()
    assert step == 1 and torch.equal(w, torch.full((256,), 1.0))
    err = capsys.readouterr().err
    assert bad.name in err and "without executing code" in err


def _distcp(path: Path) -> Path:
    (data,) = path.glob("*.distcp")
    return data


def _replace_tensor_bytes(path: Path, fqn: str, data: bytes) -> None:
    """Put `data` where the checkpoint at `path` stores tensor `fqn`, fix DCP's metadata (offsets,
    lengths) to point at it and reseal the checksums: a crafted checkpoint that DCP's metadata and
    every checksum call intact."""
    import pickle

    metadata = pickle.loads((path / ".metadata").read_bytes())
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == fqn]
    file = path / info.relative_path
    raw = file.read_bytes()
    file.write_bytes(raw[: info.offset] + data + raw[info.offset + info.length :])
    for other in metadata.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += len(data) - info.length
    info.length = len(data)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(path)


def _saved_bytes(value) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


@pytest.mark.parametrize("content", ["payload", "wrong_shape", "wrong_dtype"])
def test_tensor_data_that_is_not_the_described_tensor_falls_back_to_the_previous_checkpoint(
    tmp_path, capsys, content
):
    marker = tmp_path / "executed"
    _Payload.marker = marker
    _, bad = _saved(tmp_path / "ck", (1, 2))
    data = {
        "payload": _Payload(),
        "wrong_shape": torch.full((255,), 2.0),
        "wrong_dtype": torch.full((256,), 2.0).double(),
    }
    _replace_tensor_bytes(bad, "model.w", _saved_bytes(data[content]))
    step, w = load_newest(tmp_path / "ck")
    assert not marker.exists()
    assert step == 1 and torch.equal(w, torch.full((256,), 1.0))
    err = capsys.readouterr().err
    assert f"skipping checkpoint {bad}" in err and "trying the previous one" in err
    reason = {
        "payload": "holds a pickled object, not a tensor",
        "wrong_shape": "of 255 elements where the metadata says",
        "wrong_dtype": "torch.float64 tensor",
    }[content]
    assert "tensor 'model.w' in" in err and reason in err


def test_a_run_whose_only_checkpoint_holds_a_payload_starts_at_step_0_with_its_weights_untouched(
    tmp_path, capsys
):
    (only,) = _saved(tmp_path / "ck", (1,))
    _replace_tensor_bytes(only, "model.w", _saved_bytes(_Payload()))
    template = {"model": {"w": torch.full((256,), 7.0)}}  # the model as initialised
    assert load_latest(tmp_path / "ck", "r", template) is None
    assert torch.equal(template["model"]["w"], torch.full((256,), 7.0))
    err = capsys.readouterr().err
    assert "holds a pickled object" in err and "starting at step 0" in err


@pytest.mark.parametrize(
    "damage",
    ["inf_bytes", "one_bit", "missing_part", "no_checksum", "bad_checksum_file", "edited_manifest"],
)
def test_corrupt_latest_checkpoint_is_reported_and_the_previous_is_used(tmp_path, capsys, damage):
    _, latest = _saved(tmp_path, (1, 2))
    data_file = _distcp(latest)
    data = bytearray(data_file.read_bytes())
    if damage == "inf_bytes":  # 64 bytes of +inf inside the tensor data: the file still loads
        w = data.find(torch.full((16,), 2.0).numpy().tobytes())
        assert w > 0
        data[w : w + 64] = torch.full((16,), math.inf).numpy().tobytes()
        data_file.write_bytes(bytes(data))
    elif damage == "one_bit":
        data[len(data) // 2] ^= 0x01
        data_file.write_bytes(bytes(data))
    elif damage == "missing_part":
        data_file.unlink()
    elif damage == "no_checksum":
        checksum_path(latest).unlink()
    elif damage == "bad_checksum_file":
        checksum_path(latest).write_text("not a checksum\n")
    else:
        (latest / "state.json").write_text(
            (latest / "state.json").read_text().replace('"step": 2', '"step": 3')
        )
    step, w = load_newest(tmp_path)
    assert step == 1 and torch.equal(w, torch.full((256,), 1.0))
    err = capsys.readouterr().err
    assert latest.name in err and "trying the previous one" in err
    reason = {
        "inf_bytes": "does not match",
        "one_bit": "does not match",
        "missing_part": "is missing",
        "no_checksum": "no checksum file",
        "bad_checksum_file": "malformed",
        "edited_manifest": "does not match",
    }[damage]
    assert reason in err


def test_no_good_checkpoint_is_said_before_starting_at_step_0(tmp_path, capsys):
    for path in _saved(tmp_path, (1, 2)):
        _distcp(path).write_bytes(_distcp(path).read_bytes()[:100])  # truncated
    assert load_newest(tmp_path) is None
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "starting at step 0" in err
    assert "step_00000001" in err and "step_00000002" in err


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3):
        save_step(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    assert sorted(p.name for p in (tmp_path / "step_00000003").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "rank_0.safetensors",
        "rank_0.sha256",
        "state.json",
        "state.json.sha256",
    ]


def test_run_resumes_bit_identical_past_a_corrupt_latest_checkpoint(tiny_data, tmp_path, capsys):
    from safetensors.torch import load_file

    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train

    _, exp, shards = tiny_data
    (spec,) = exp.runs.values()
    spec = copy.deepcopy(spec)
    spec.train.total_steps, spec.train.checkpoint_every = 12, 4
    full = RunPaths(tmp_path / "full", tmp_path / "full_work")
    train(spec, shards, full, progress=False)
    part = RunPaths(tmp_path / "part", tmp_path / "part_work")
    train(spec, shards, part, progress=False, stop_after=9)  # checkpoints at 8 and 9
    latest = list_checkpoints(part.checkpoints)[-1][1]
    assert latest.name == "step_00000009"
    data_file = _distcp(latest)
    data = bytearray(data_file.read_bytes())
    data[len(data) // 3] ^= 0x10
    data_file.write_bytes(bytes(data))
    train(spec, shards, part, progress=False)
    err = capsys.readouterr().err
    assert "step_00000009" in err and "resumed from step 8" in err
    a, b = load_file(full.weights), load_file(part.weights)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _calls(text: str, name: str) -> list[str]:
    """The full text of every call `name(...)` in `text` (balanced parentheses)."""
    out = []
    for m in re.finditer(re.escape(name) + r"\(", text):
        depth, i = 0, m.end() - 1
        while True:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        out.append(text[m.start() : i + 1])
    return out


def test_no_torch_load_executes_pickled_code_anywhere():
    """Every torch.load in the package and the workflow scripts passes weights_only=True."""
    calls = [
        (p.name, c)
        for p in [*(REPO / "depthbench").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
        for c in _calls(p.read_text(), "torch.load")
    ]
    assert calls
    for name, call in calls:
        assert re.search(r"weights_only\s*=\s*True", call), (name, call)
    # the one unpickler that reads files: DCP's metadata, through an allow-list (dcp_io.py)
    readers = [
        p.name
        for p in (REPO / "depthbench").rglob("*.py")
        if re.search(r"pickle\.load\(|Unpickler\(", p.read_text())
    ]
    assert (
        readers == ["dcp_io.py"]
        and "def find_class" in (REPO / "depthbench/train/dcp_io.py").read_text()
    )
