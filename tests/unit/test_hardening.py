"""Hardening (issue 20): each bad input or fault is injected, and gets an error naming the field
or file before any training step, or is survived with nothing lost."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import yaml

from depthbench.spec.run import RunSpec
from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.util.errors import ConfigError, DataError
from depthbench.util.io import atomic_write_text
from depthbench.models.config import ModelConfig
from depthbench.train.checkpoint import (
    checksum_path,
    list_checkpoints,
    load_latest,
    save_checkpoint,
)
from tests.conftest import REPO, status_grid, tiny_config


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((256,), float(step))}}


def _save(folder: Path, step: int, run_id: str = "r", keep: int = 5) -> Path:
    return save_checkpoint(
        folder,
        step,
        run_id,
        _state(step),
        {"last_val": float("nan")},
        rank_tensors={"torch": torch.get_rng_state()},
        keep=keep,
    )


def _load(folder: Path, run_id: str = "r", size: int = 256):
    """(step, loaded weights) of the checkpoint load_latest picks, or None."""
    template = {"model": {"w": torch.zeros(size)}}
    found = load_latest(folder, run_id, template)
    return None if found is None else (found.step, template["model"]["w"])


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


# -- 1. checkpoints: no code execution, checksums, fallback with a report --------------------------
def _saved(folder: Path, steps=(1, 2)) -> list[Path]:
    return [_save(folder, s) for s in steps]


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
    else:  # a genuine DCP checkpoint whose entry is an object, which DCP loads with torch.load(weights_only=False)
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
    step, w = _load(tmp_path / "ck")
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
    step, w = _load(tmp_path / "ck")
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
    step, w = _load(tmp_path)
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
    assert _load(tmp_path) is None
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "starting at step 0" in err
    assert "step_00000001" in err and "step_00000002" in err


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    assert sorted(p.name for p in (tmp_path / "step_00000003").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "rank_0.safetensors",
        "rank_0.sha256",
        "state.json",
        "state.json.sha256",
    ]


_KILL_SCRIPT = """
import os, sys, time, torch
from depthbench.train import checkpoint as ck
folder, where = sys.argv[1], sys.argv[2]
state = lambda s: {"model": {"w": torch.full((4096,), float(s))}}
ck.save_checkpoint(folder, 1, "r", state(1))
def hang(*args):
    print("in the write", flush=True)
    time.sleep(600)
if where == "data":  # the new checkpoint's files are being written into step_2.tmp/
    os.fsync = hang
else:  # its manifest and checksum are written, the folder not yet renamed
    ck._fsync_dir = hang
ck.save_checkpoint(folder, 2, "r", state(2))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["data", "complete"])
def test_kill_9_during_a_checkpoint_write_keeps_and_uses_the_previous_one(tmp_path, where):
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, str(tmp_path), where],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "in the write"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert (tmp_path / "step_00000002.tmp").is_dir()
    if where == "complete":
        assert checksum_path(tmp_path / "step_00000002.tmp").is_file()
    step, w = _load(tmp_path, size=4096)
    assert step == 1 and torch.equal(w, torch.full((4096,), 1.0))
    _save(tmp_path, 2)  # the next save replaces the half-written one
    assert _load(tmp_path)[0] == 2
    assert not list(tmp_path.glob("*.tmp")) and not list(
        tmp_path.glob(".*")
    )  # and removes what the killed write left


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


# -- 2. outputs checked against their identity ------------------------------------------------------
def _fake_summary(results: Path, spec: RunSpec, status: str = "ok", **extra) -> Path:
    run = results / "runs" / spec.run_id
    run.mkdir(parents=True, exist_ok=True)
    summary = {
        "run_id": spec.run_id,
        "status": status,
        "steps": 3,
        "total_steps": 10,
        "tokens_seen": 768,
        "final_val_loss": 5.0 if status == "ok" else math.nan,
        "wall_seconds": 1.0,
        "tokens_per_s": 768.0,
        "n_params": spec.shape.n_params,
        "device": "cpu",
        "world_size": 1,
        "spec": spec.to_dict(),
        "spec_hash": spec.spec_hash(),
        **extra,
    }
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 2, "train_loss": 5.5, "val_loss": 5.4}) + "\n"
    )
    (run / "model.safetensors").write_bytes(b"weights")
    return run / "summary.json"


def _grid(wiki_jsonl, **kw) -> dict:
    return load_config(tiny_config(wiki_jsonl, **kw))


@pytest.fixture(scope="module")
def grid4(wiki_jsonl):
    return expand_grid(
        _grid(wiki_jsonl, architectures=["pre_ln", "post_ln"], learning_rates=[3e-3, 50.0])
    )


def test_spec_hash_survives_the_train_rules_round_trip(grid4):
    """What scripts/train.py rebuilds from the rule's params (identity + operational settings)
    and writes into summary.json hashes to the grid's spec hash."""
    for spec in grid4.runs.values():
        rebuilt = RunSpec.from_dict(spec.identity_dict()).with_operational(
            {"threads": 2, "checkpoint_every": 7}
        )
        assert (
            RunSpec.from_dict(json.loads(json.dumps(rebuilt.to_dict()))).spec_hash()
            == spec.spec_hash()
        )
    assert len({s.spec_hash() for s in grid4.runs.values()}) == len(grid4.runs)


def test_summary_of_another_run_or_version_is_refused_by_name(grid4, tmp_path):
    from depthbench.train.runcheck import read_summary
    from depthbench.analysis.tables import run_rows

    a, b = list(grid4.runs.values())[:2]
    expected = {s.run_id: s.spec_hash() for s in grid4.runs.values()}
    pa, pb = _fake_summary(tmp_path, a), _fake_summary(tmp_path, b)
    assert len(run_rows([str(pa), str(pb)], 6.0, "tiny", expected=expected)) == 2
    pb.write_text(pa.read_text())  # copied over another run's
    with pytest.raises(DataError, match=re.escape(str(pb)) + ".*belongs to run"):
        run_rows([str(pa), str(pb)], 6.0, "tiny", expected=expected)
    _fake_summary(tmp_path, b)
    with pytest.raises(DataError, match=re.escape(str(pb)) + ".*grid's spec"):
        read_summary(pb, {**expected, b.run_id: "0" * 16})  # the grid changed since it was written
    edited = json.loads(pb.read_text())
    edited["spec"]["train"]["weight_decay"] = 0.5
    pb.write_text(json.dumps(edited))
    with pytest.raises(DataError, match="edited"):
        read_summary(pb, expected)


@pytest.mark.parametrize("content", ['{"run_id": "x", "status": "o', "", "\xff\xfe", "[1, 2]"])
def test_truncated_or_unreadable_summary_is_an_error_naming_the_file(grid4, tmp_path, content):
    from depthbench.analysis.tables import run_rows

    path = _fake_summary(tmp_path, next(iter(grid4.runs.values())))
    path.write_bytes(content.encode("latin-1"))
    with pytest.raises(DataError, match=re.escape(str(path))):
        run_rows([str(path)], 6.0, "tiny")


# -- 3. corpus contents ------------------------------------------------------------------------------
CORPUS_CASES = {
    "empty.jsonl": (b"", "is empty"),
    "blank.jsonl": (b"\n  \n\n", "no non-empty document"),
    "latin1.jsonl": (
        b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
        "line 2 (byte offset 28) is not UTF-8",
    ),
    "broken.jsonl": (b'{"text": "ok"}\n{"text": "cut\n', "line 2, column 10: not valid JSON"),
    "latin1.txt": (
        b"first paragraph\n\nsecond \xe9t\xe9\n",
        "line 3 (byte offset 24) is not UTF-8",
    ),
}


@pytest.mark.parametrize("name", sorted(CORPUS_CASES))
def test_bad_corpus_is_refused_at_validation_naming_file_and_line(wiki_jsonl, tmp_path, name):
    data, message = CORPUS_CASES[name]
    path = tmp_path / name
    path.write_bytes(data)
    config = tiny_config(wiki_jsonl)
    config["corpus"]["path"] = str(path)
    with pytest.raises(DataError, match=re.escape(str(path)) + ".*" + re.escape(message)):
        expand_grid(load_config(config))


def test_bad_bytes_past_the_checked_head_fail_before_the_tokenizer_is_trained(
    wiki_jsonl, tmp_path, monkeypatch
):
    from depthbench.data import prepare

    from depthbench.data.corpus_checks import HEAD_BYTES

    head = wiki_jsonl.read_bytes() * (1 + HEAD_BYTES // len(wiki_jsonl.read_bytes()))
    path = tmp_path / "big.jsonl"
    path.write_bytes(head + b'{"text": "\xff"}\n')
    lines = head.count(b"\n")
    config = load_config(tiny_config(path))
    expand_grid(config)  # only the head is read at config time
    monkeypatch.setattr(prepare, "train_bpe", lambda *a: pytest.fail("the tokenizer was trained"))
    with pytest.raises(DataError, match=re.escape(str(path)) + f".*line {lines + 1} .*not UTF-8"):
        prepare.build_tokenizer(config, str(tmp_path / "tok.json"))


def test_missing_text_field_names_the_field_and_line(wiki_jsonl, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"body": "text"}\n')
    config = tiny_config(wiki_jsonl)
    config["corpus"]["path"] = str(path)
    with pytest.raises(ConfigError, match=r"corpus\.text_field.*line 1"):
        expand_grid(load_config(config))


# -- 4. numbers and init rules ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit, field",
    [
        ("learning_rates: [.nan]", "learning_rates[0]"),
        ("learning_rates: [.inf]", "learning_rates[0]"),
        ("learning_rates: [-.inf]", "learning_rates[0]"),
        ("budget: {params: .nan, d_model_multiple: 16, d_ff_multiple: 16}", "budget.params"),
        ("train: {weight_decay: .inf}", "train.weight_decay"),
        ("sweep: {train.weight_decay: [0.1, .nan]}", "sweep.train.weight_decay[1]"),
        ("sweep: {train.weight_decay: [0.1, -1]}", "sweep.train.weight_decay[1]"),
        ("sweep: {train.beta2: [0.95, 1.5]}", "sweep.train.beta2[1]"),
        ("sweep: {model.n_head: [2, 0]}", "sweep.model.n_head[1]"),
    ],
)
def test_numbers_that_are_not_finite_or_in_range_name_the_field(wiki_jsonl, tmp_path, edit, field):
    config = tiny_config(wiki_jsonl)
    config.update(yaml.safe_load(edit))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert exc.value.field == field


@pytest.mark.parametrize(
    "rule", ["10**10**10", "sqrt(-1)", "1/(d_model-d_model)", "-0.02", "(" * 400 + "1" + ")" * 400]
)
def test_init_rules_are_evaluated_at_validation_naming_model_init_std(wiki_jsonl, rule):
    config = tiny_config(wiki_jsonl)
    config["model"] = {"n_head": 2, "init_std": rule}
    with pytest.raises(ConfigError) as exc:
        expand_grid(load_config(config))
    assert exc.value.field == "model.init_std"


# -- 6. permissions -----------------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_outputs_get_the_mode_the_umask_allows(tmp_path, umask):
    from depthbench.analysis.tables import write_parquet

    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        write_parquet(pd.DataFrame({"a": [1]}), tmp_path / "t.parquet")
        _save(tmp_path / "ck", 1)
        (tmp_path / "plain.txt").write_text("x")  # what open() gives: the reference
    finally:
        os.umask(old)
    want = (tmp_path / "plain.txt").stat().st_mode & 0o777
    assert want == 0o666 & ~umask
    ck = [
        f"ck/step_00000001/{n}"
        for n in (
            ".metadata",
            "__0_0.distcp",
            "rank_0.safetensors",
            "state.json",
            "state.json.sha256",
        )
    ]
    for p in ("a.txt", "t.parquet", *ck):
        assert (tmp_path / p).stat().st_mode & 0o777 == want, p


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_folder_is_replaced_whole_with_an_ordinary_folders_mode(tmp_path, umask):
    """atomic_folder (HF exports, published snapshots): the new folder replaces the old one only
    once it is complete, with mkdir's mode, and a failure leaves the old folder as it was."""
    from depthbench.util.io import atomic_folder

    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_folder(target) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("killed half-way")
    assert [p.name for p in target.iterdir()] == ["old.txt"] and len(list(tmp_path.iterdir())) == 1
    old = os.umask(umask)
    try:
        with atomic_folder(target) as tmp:
            (tmp / "new.txt").write_text("new")
        (tmp_path / "plain").mkdir()  # what mkdir gives: the reference
    finally:
        os.umask(old)
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert (
        target.stat().st_mode & 0o777
        == (tmp_path / "plain").stat().st_mode & 0o777
        == 0o777 & ~umask
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "out",
        "plain",
    ]  # no temporary or old folder left
    # a file, or a link, where the folder goes is replaced too
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(target)
    for name in ("file", "link"):
        with atomic_folder(tmp_path / name) as tmp:
            (tmp / "new.txt").write_text("new")
        assert (tmp_path / name).is_dir() and not (tmp_path / name).is_symlink()
    assert [p.name for p in target.iterdir()] == ["new.txt"]  # the link's target untouched


def test_a_folder_that_cannot_be_renamed_in_leaves_the_old_one(tmp_path, monkeypatch):
    from depthbench.util.io import atomic_folder

    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    real = os.replace

    def fail_on_the_new_folder(src, dst):
        if str(src).endswith(".tmp"):
            raise OSError("disk gone")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_the_new_folder)
    with pytest.raises(OSError, match="disk gone"):
        with atomic_folder(target) as tmp:
            (tmp / "new.txt").write_text("new")
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing temporary left


# -- 7. the smaller items -----------------------------------------------------------------------------
def test_head_count_hint_lists_exactly_the_counts_that_pass_every_check():
    with pytest.raises(ConfigError) as exc:
        ModelConfig(d_model=48, n_head=5, vocab_size=50, n_layer=1)
    hinted = json.loads(
        re.search(r"valid head counts for this width: (\[.*\])", str(exc.value)).group(1)
    )

    def builds(h):
        try:
            ModelConfig(d_model=48, n_head=h, vocab_size=50, n_layer=1)
            return True
        except ConfigError:
            return False

    assert hinted == [h for h in range(1, 65) if builds(h)] == [1, 2, 3, 4, 6, 8, 12, 24]


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ncorpus:\n  name: [unclosed\nshapes: []\n")
    with pytest.raises(
        ConfigError, match=re.escape(str(path)) + r": line \d+, column \d+: YAML syntax error"
    ):
        load_config(path)
    path.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


def test_tokenizer_file_that_is_not_json_names_the_field_and_path(wiki_jsonl, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("this is not JSON")
    config = tiny_config(wiki_jsonl, tokenizer={"kind": "file", "path": str(path)})
    with pytest.raises(ConfigError) as exc:
        expand_grid(load_config(config))
    assert exc.value.field == "tokenizer.path" and str(path) in str(exc.value)


# -- 5. table stages on degenerate grids ----------------------------------------------------------------
class _Files(list):
    """A Snakemake-like named file list: indexable, and with attributes."""

    def __init__(self, items=(), **named):
        super().__init__(items or named.values())
        self.__dict__.update(named)


def _run_script(name: str, **parts) -> None:
    runpy.run_path(
        str(REPO / "scripts" / name), init_globals={"snakemake": SimpleNamespace(**parts)}
    )


def _degenerate(wiki_jsonl, kind):
    if kind == "all_diverged":
        exp = expand_grid(
            _grid(
                wiki_jsonl,
                architectures=["pre_ln", "post_ln"],
                shapes=[{"n_layer": 1}, {"n_layer": 2}],
                learning_rates=[50.0, 80.0],
            )
        )
        return exp, {rid: "diverged" for rid in exp.runs}
    if kind == "single_run":
        exp = expand_grid(_grid(wiki_jsonl))
        return exp, {rid: "ok" for rid in exp.runs}
    if kind == "single_shape":
        exp = expand_grid(
            _grid(wiki_jsonl, architectures=["pre_ln", "post_ln"], learning_rates=[3e-3, 50.0])
        )
        return exp, {rid: "diverged" if "_lr50_" in rid else "ok" for rid in exp.runs}
    exp = expand_grid(_grid(wiki_jsonl))
    return exp, {}  # empty: no run of the grid has outputs to aggregate


@pytest.mark.parametrize("kind", ["all_diverged", "single_run", "single_shape", "empty"])
def test_every_table_stage_finishes_on_degenerate_grids(wiki_jsonl, tmp_path, kind):
    from depthbench.data.shards import META_VERSION

    exp, statuses = _degenerate(wiki_jsonl, kind)
    res = tmp_path / "results"
    data = res / "data" / "meta.json"
    data.parent.mkdir(parents=True)
    data.write_text(json.dumps({"version": META_VERSION, "unigram_val_loss": 6.0}))
    specs = [exp.runs[rid] for rid in statuses]
    summaries = [str(_fake_summary(res, s, statuses[s.run_id])) for s in specs]
    metrics = [str(Path(p).with_name("metrics.jsonl")) for p in summaries]
    probes, nll = [], []
    for s in specs:
        trained = statuses[s.run_id] == "ok"
        p = res / "probes" / f"{s.run_id}.parquet"
        p.parent.mkdir(exist_ok=True)
        pd.DataFrame(
            {
                "run_id": s.run_id,
                "probe": ["causal_score"] * (1 + trained),
                "stage": ["init", "trained"][: 1 + trained],
                "i": 0,
                "j": 0,
                "value": 0.5,
                "status": statuses[s.run_id],
            }
        ).to_parquet(p)
        n = res / "nll" / f"{s.run_id}.parquet"
        n.parent.mkdir(exist_ok=True)
        pd.DataFrame(
            {
                "run_id": s.run_id,
                "level": ["set", "domain"],
                "set": ["gsm8k", ""],
                "domain": ["math", "math"],
                "nats_per_token": 2.0 if trained else math.nan,
                "bits_per_byte": 1.0 if trained else math.nan,
                "status": statuses[s.run_id],
            }
        ).to_parquet(n)
        probes.append(str(p))
        nll.append(str(n))
    tables = res / "tables"
    out = _Files(
        runs=str(tables / "runs.parquet"),
        curves=str(tables / "curves.parquet"),
        best_lr=str(tables / "best_lr.parquet"),
        dynamics=str(tables / "dynamics.parquet"),
    )
    hashes = {s.run_id: s.spec_hash() for s in specs}
    log = _Files([str(tmp_path / "log.txt")])
    _run_script(
        "tables.py",
        input=_Files(summaries=summaries, metrics=metrics, data=str(data), pretrained=[]),
        output=out,
        log=log,
        params=SimpleNamespace(
            experiment="tiny", run_ids=list(statuses), spec_hashes=hashes, budget_params=None
        ),
    )
    made = {}
    removal = []  # a removal file per run: no rows for a diverged run (depthbench.probes.removal_run)
    for s in specs:
        r = res / "removal" / f"{s.run_id}.parquet"
        r.parent.mkdir(exist_ok=True)
        rows = (
            [
                {
                    "ranking": "last",
                    "draw": 0,
                    "k": k,
                    "fraction": k / 2,
                    "removed": "",
                    "domain": "val",
                    "loss": 2.0 + k,
                    "full_loss": 2.0,
                    "change": k / 2,
                }
                for k in (0, 1)
            ]
            if statuses[s.run_id] == "ok"
            else []
        )
        pd.DataFrame(
            rows,
            columns=[
                "ranking",
                "draw",
                "k",
                "fraction",
                "removed",
                "domain",
                "loss",
                "full_loss",
                "change",
            ],
        ).assign(run_id=s.run_id, status=statuses[s.run_id]).to_parquet(r)
        removal.append(str(r))
    for script, extra, target, outputs in (
        ("cost_table.py", {"summaries": summaries, "pretrained": []}, "cost", ("cost",)),
        ("probes_table.py", {"probes": probes}, "probes", ("probes", "lens")),
        ("nll_table.py", {"nll": nll}, "nll", ("nll",)),
        ("removal_table.py", {"removal": removal}, "removal", ("removal", "effective_depth")),
    ):
        paths = {name: str(tables / f"{name}.parquet") for name in outputs}
        _run_script(
            script,
            input=_Files(**extra, runs=out.runs, best_lr=out.best_lr),
            output=_Files(**paths),
            log=log,
            params=SimpleNamespace(spec_hashes=hashes, seq_len=32, tolerance=0.05),
        )
        made.update({name: pd.read_parquet(path) for name, path in paths.items()})
    runs, best = pd.read_parquet(out.runs), pd.read_parquet(out.best_lr)
    assert sorted(runs.run_id) == sorted(statuses)
    n_ok = sum(v == "ok" for v in statuses.values())
    groups = {(s.arch, s.shape.n_layer) for s in specs if statuses[s.run_id] == "ok"}
    assert len(best) == len(groups) and (n_ok == 0) == best.empty
    assert sorted(made["cost"].get("run_id", pd.Series(dtype=str))) == sorted(statuses)
    assert sorted(set(made["probes"].run_id)) == sorted(statuses) and "is_best_lr" in made["probes"]
    assert sorted(set(made["nll"].run_id)) == sorted(statuses) and "arch" in made["nll"]
    if n_ok:
        assert made["probes"][made["probes"].stage == "trained"].is_best_lr.all()
    ok = sorted(r for r, v in statuses.items() if v == "ok")
    assert (
        sorted(set(made["removal"].get("run_id", []))) == ok
        and sorted(made["effective_depth"].get("run_id", [])) == ok
    )


# -- 8. depthbench status -------------------------------------------------------------------------------
def test_status_reports_each_run_and_the_next_jobs(wiki_jsonl, tmp_path, capsys):
    from depthbench.commands.cli import main

    config = tiny_config(
        wiki_jsonl, architectures=["pre_ln", "post_ln", "peri_ln"], learning_rates=[3e-3, 50.0]
    )
    cfg, exp, res = status_grid(config, tmp_path)
    ids = list(exp.runs)
    trained, diverged, partial, stale_time, copied, missing = ids
    for rid in ids[:5]:
        _fake_summary(res, exp.runs[rid], "diverged" if rid == diverged else "ok")
    (res / "probes").mkdir()
    (res / "probes" / f"{trained}.parquet").write_bytes(b"x")
    (res / "runs" / partial / "summary.json").unlink()
    _save(res / "work" / partial / "checkpoints", 4, partial)
    os.utime(res / "runs" / stale_time / "summary.json", (1e8, 1e8))  # older than the shards
    (res / "runs" / copied / "summary.json").write_text(
        (res / "runs" / trained / "summary.json").read_text()
    )
    assert main(["status", str(cfg), "--results", str(res)]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.split() and line.split()[0] in ids
    }
    assert rows[trained] == ["trained", "yes", "-", "-"]
    assert rows[diverged] == ["diverged", "no", "-", "probe"]
    assert rows[partial] == ["partial", "no", "-", "train", "(resume),", "probe"]
    assert rows[stale_time][:2] == ["stale", "no"] and rows[missing][0] == "missing"
    assert rows[copied][:4] == ["invalid", "no", "-", "none:"]  # snakemake would not retrain it
    assert (
        "belongs to run" in out and "older than its input" in out and "checkpoint at step 4" in out
    )
    assert "train: 2 runs" in out and "train (resume): 1 run" in out and "probe: 5 runs" in out
    assert "tables: fail on 1 invalid summary" in out


def test_status_with_best_lr_evaluation_names_only_the_best_runs(wiki_jsonl, tmp_path, capsys):
    from depthbench.commands.cli import main
    from depthbench.analysis.tables import best_learning_rates

    config = tiny_config(wiki_jsonl, learning_rates=[3e-3, 1e-2])
    config["probes"] = {"runs": "best_lr"}
    cfg, exp, res = status_grid(config, tmp_path)
    low, high = sorted(exp.runs, key=lambda rid: exp.runs[rid].lr)
    for rid in (low, high):
        _fake_summary(res, exp.runs[rid])

    def rows():
        assert main(["status", str(cfg), "--results", str(res)]) == 0
        out = capsys.readouterr().out
        return {
            line.split()[0]: line.split()[1:3]
            for line in out.splitlines()
            if line.split() and line.split()[0] in (low, high)
        }

    assert rows() == {low: ["trained", "later"], high: ["trained", "later"]}  # no best_lr table yet
    runs = pd.DataFrame(
        [
            {
                "run_id": rid,
                "experiment": "tiny",
                "arch": s.arch,
                "n_layer": s.shape.n_layer,
                "d_model": s.shape.d_model,
                "knobs": "{}",
                "ratio": 1.0,
                "params": 1,
                "params_vs_budget": 0.0,
                "lr": s.lr,
                "seed": s.seed,
                "status": "ok",
                "final_val_loss": 4.0 if rid == high else 4.5,
            }
            for rid, s in exp.runs.items()
        ]
    )
    (res / "tables").mkdir()
    runs.to_parquet(res / "tables" / "runs.parquet")
    best_learning_rates(runs).to_parquet(res / "tables" / "best_lr.parquet")
    assert rows() == {low: ["trained", "-"], high: ["trained", "no"]}  # only the best LR is probed
