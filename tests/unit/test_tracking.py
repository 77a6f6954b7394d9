"""Experiment tracking (train.loggers): the TensorBoard event files and the offline wandb run of a
tiny run, read back with the packages' own readers, hold what metrics.jsonl holds; a missing
package fails before training; the setting is not part of the run id."""

import json
import shutil
import struct
import zlib

import pytest

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.util.errors import ConfigError
from depthbench.train.checkpoint_folder import list_checkpoints
from depthbench.train.recipe import RunPaths
from depthbench.train.loop import train
from tests.conftest import tiny_config
from tests.run_outputs import only_run, with_steps

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")


def _records(paths):
    return [json.loads(line) for line in paths.curves.read_text().splitlines()]


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc, {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
    }


def wandb_records(path):
    """The protobuf records of an offline .wandb file (wandb's LevelDB-style log: a 7-byte
    header ':W&B', 0xBEE1, version 0; 32 KiB blocks of chunks with a CRC-32 of type + data, a
    2-byte length and a type: 1 full, 2 first, 3 middle, 4 last), parsed with wandb's Record."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B" and struct.unpack("<H", raw[4:6])[0] == 0xBEE1 and raw[6] == 0
    pos, pending, block = 7, b"", 32768
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data = raw[pos + 7 : pos + 7 + length]
        if kind == 0 and length == 0:
            break
        assert crc == zlib.crc32(bytes([kind]) + data), f"corrupt chunk at byte {pos}"
        pending, pos = pending + data, pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _key(item):
    """An item's name: wandb writes it as `key` or, for the history, as a one-element
    `nested_key`."""
    return item.key or "/".join(item.nested_key)


@pytest.fixture(scope="module")
def tracked_run(tiny_data, tmp_path_factory):
    _, exp, shards = tiny_data
    spec = with_steps(only_run(exp), 8, log_every=2, eval_every=4, dynamics_every=4)
    spec.train.loggers, spec.train.experiment = ["tensorboard", "wandb"], "tiny"
    root = tmp_path_factory.mktemp("tracked")
    paths = RunPaths(root / "run", root / "work")
    summary = train(spec, shards, paths, progress=False)
    assert summary["status"] == "ok"
    return spec, paths


def test_tensorboard_events_hold_the_metrics_and_the_run(tracked_run):
    from tensorboard.plugins.hparams import plugin_data_pb2

    spec, paths = tracked_run
    acc, scalars = _scalars(paths.work_dir / "tensorboard")
    records = _records(paths)
    for key, tag in (
        ("train_loss", "train/loss"),
        ("lr", "train/lr"),
        ("grad_norm", "train/grad_norm"),
        ("tokens_per_s", "perf/tokens_per_s"),
        ("mfu", "perf/mfu"),
        ("mfu_measured", "perf/mfu_measured"),
        ("val_loss", "val/loss"),
    ):
        want = [(r["step"], r[key]) for r in records if key in r]
        assert [s for s, _ in scalars[tag]] == [s for s, _ in want] and want, tag
        assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in want], rel=1e-6), (
            tag
        )  # float32 events
    dyn = [r["dynamics"] for r in records if "dynamics" in r]
    assert [v for _, v in scalars["dynamics/residual_rms/0"]] == pytest.approx(
        [d["residual_rms"][0] for d in dyn], rel=1e-6
    )
    assert [v for _, v in scalars["dynamics/norm_factor/final_norm"]] == pytest.approx(
        [d["norm_factor"]["final_norm"] for d in dyn], rel=1e-6
    )
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config_text.strip("`\n")) == spec.to_dict()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["experiment"].string_value == "tiny" and hp["arch"].string_value == spec.arch
    assert (
        hp["shape"].string_value == spec.shape.tag
        and hp["lr"].number_value == spec.lr
        and hp["seed"].number_value == spec.seed
    )


def test_offline_wandb_run_holds_the_metrics_config_group_and_tags(tracked_run):
    spec, paths = tracked_run
    (run_file,) = (paths.work_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == spec.run_id and run.run_group == "tiny"
    assert set(run.tags) == {spec.arch, spec.shape.tag, f"lr{spec.lr:g}", f"seed{spec.seed}"}
    config = {_key(item): json.loads(item.value_json) for item in run.config.update}
    assert (
        config["run_id"] == spec.run_id
        and config["train"]["total_steps"] == 8
        and config["experiment"] == "tiny"
    )
    history = [
        {_key(i): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    ours = _records(paths)
    assert [h["step"] for h in history] == [r["step"] for r in ours]
    for h, r in zip(history, ours):
        for key, name in (
            ("train_loss", "train/loss"),
            ("val_loss", "val/loss"),
            ("mfu_measured", "perf/mfu_measured"),
        ):
            if key in r:
                assert h[name] == pytest.approx(r[key], rel=1e-12), (r["step"], key)
        if "dynamics" in r:
            assert h["dynamics/grad_norm_h/1"] == pytest.approx(
                r["dynamics"]["grad_norm_h"][1], rel=1e-12
            )


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tiny_data, tmp_path):
    _, exp, shards = tiny_data
    spec = with_steps(only_run(exp), 8, log_every=1, eval_every=8, checkpoint_every=3)
    spec.train.loggers = ["tensorboard"]
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    train(spec, shards, paths, progress=False, stop_after=5)
    step, last = list_checkpoints(paths.checkpoints)[-1]
    assert step == 5
    shutil.rmtree(
        last
    )  # as if the process had been killed after step 5, before its last checkpoint
    train(spec, shards, paths, progress=False)  # resumes from step 3, redoes 4 and 5
    _, scalars = _scalars(paths.work_dir / "tensorboard")
    want = [(r["step"], r["train_loss"]) for r in _records(paths)]
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 9)) == [s for s, _ in want]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([v for _, v in want], rel=1e-6)


def test_missing_tracker_package_fails_before_training(tiny_data, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    _, exp, shards = tiny_data
    spec = with_steps(only_run(exp), 2)
    spec.train.loggers = ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match=r"train\.loggers.*pip install"):
        train(spec, shards, RunPaths(tmp_path / "run", tmp_path / "work"), progress=False)
    assert not (tmp_path / "work").exists()  # nothing started
    spec.train.loggers = ["mlflow"]
    with pytest.raises(ConfigError, match=r"train\.loggers.*valid: \['tensorboard', 'wandb'\]"):
        train(spec, shards, RunPaths(tmp_path / "run", tmp_path / "work"), progress=False)


def test_loggers_are_in_the_schema_and_not_in_the_run_id(wiki_jsonl):
    base = tiny_config(wiki_jsonl)
    plain = only_run(expand_grid(load_config(base)))
    tracked = only_run(
        expand_grid(
            load_config({**base, "train": {**base["train"], "loggers": ["wandb", "tensorboard"]}})
        )
    )
    assert plain.run_id == tracked.run_id and plain.train.loggers == []
    with pytest.raises(ConfigError, match="loggers"):
        load_config({**base, "train": {**base["train"], "loggers": ["mlflow"]}})
