"""`depthbench export RUN_DIR OUT_DIR`: a finished run as a transformers model directory.

Reads RUN_DIR/summary.json (its "spec" is the RunSpec dict) and RUN_DIR/model.safetensors, and,
under the results folder that holds RUN_DIR (results/runs/<run_id>), the run's tokenizer
(tokenizers/<tokenizer_id>/tokenizer.json) and data description (data/<data_id>/meta.json:
EOS id, corpus, token counts). Writes config.json, model.safetensors, the tokenizer as a
`PreTrainedTokenizerFast`, generation_config.json and a model card (README.md).

pre_ln exports as a plain `LlamaForCausalLM` (depthbench.hf.llama; options of other
architectures in the run's `arch_options` do not count). Every other architecture (and pre_ln
with MoE) exports for `AutoModelForCausalLM` with `trust_remote_code=True`: the files of
depthbench/hf/remote_code are copied in, config.json's `auto_map` names them, and the weights keep
DepthBench's names under the prefix `depthbench.`. Loading such an export needs `depthbench`
installed beside transformers.

Tokenizer: transformers' `AutoTokenizer.from_pretrained(folder)` reads the folder's config.json
before the tokenizer files, and a config.json whose `auto_map` names remote code makes it ask
whether to run that code (the tokenizer files themselves name only transformers' own classes).
`import depthbench.hf.auto` registers DepthBench's classes as local ones, after which the
tokenizer and the model load from OUT_DIR with no prompt (depthbench.hf.auto). Without that
import, a remote-code export's tokenizer loads alone from `tokenizer/`
(`AutoTokenizer.from_pretrained(OUT_DIR / "tokenizer")`, no remote code, no prompt); a Llama
export loads from OUT_DIR itself.

Special tokens: EOS is the tokenizer's EOS (the document separator of the token shards); BOS
and PAD are the same token. BOS = EOS because training documents follow an EOS, which is also
what lm-evaluation-harness prepends to an empty context (its prefix token is the BOS); PAD =
EOS because nothing was trained to be a padding token and padded positions are never scored.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from depthbench.util.errors import ConfigError, DataError
from depthbench.hf.card import model_card
from depthbench.hf.llama import is_plain_llama, llama_config_kwargs, to_llama_state_dict
from depthbench.util.io import atomic_folder
from depthbench.models.config import ModelConfig

REMOTE_CODE = Path(__file__).parent / "remote_code"
REMOTE_FILES = ("configuration_depthbench.py", "modeling_depthbench.py")
PREFIX = "depthbench."
TOKENIZER_FOLDER = "tokenizer"  # in remote-code exports: the tokenizer without config.json


@dataclass
class Run:
    run_dir: Path
    summary: dict
    spec: dict
    model: ModelConfig
    arch: str
    tokenizer_path: Path
    data_meta: dict = field(default_factory=dict)
    last_train_loss: float = math.nan


def load_run(run_dir: str | os.PathLike, results_dir: str | os.PathLike | None = None) -> Run:
    """Everything an export reads about a run; DataError naming the missing file otherwise."""
    from depthbench.models.registry import canonical_arch
    from depthbench.train.runcheck import check_run, verify_weights

    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise DataError(
            f"{summary_path}: no such file; "
            "RUN_DIR must be a finished run's folder (results/runs/<run_id>)"
        )
    # its identity: run id of its folder, spec hash of its spec
    summary = check_run(run_dir, weights=False)
    if summary.get("status") != "ok":
        raise DataError(
            f"{summary_path}: status {summary.get('status')!r}; "
            "only runs with status 'ok' can be exported"
        )
    verify_weights(run_dir, summary)  # before anything is written
    spec = summary["spec"]
    results = Path(results_dir) if results_dir else run_dir.resolve().parent.parent
    tok = results / "tokenizers" / spec["tokenizer_id"] / "tokenizer.json"
    if not tok.is_file():
        raise DataError(
            f"{tok}: no such file (the run's tokenizer, tokenizer_id {spec['tokenizer_id']}); "
            "pass --results with the results folder that holds tokenizers/ and data/"
        )
    meta_path = results / "data" / spec["data_id"] / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    last = math.nan
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        losses = [
            r["train_loss"]
            for r in map(json.loads, filter(str.strip, metrics.read_text().splitlines()))
            if "train_loss" in r
        ]
        last = losses[-1] if losses else math.nan
    cfg = ModelConfig.from_dict(spec["model"])
    return Run(run_dir, summary, spec, cfg, canonical_arch(cfg.arch), tok, meta, last)


def special_tokens(run: Run, tokenizer) -> dict[str, tuple[str, int]]:
    """eos/bos/pad as (token, id): the data's EOS id when its meta.json is there, else the
    tokenizer's usual EOS names (depthbench.data.tokenizer.EOS_CANDIDATES)."""
    from depthbench.data.tokenizer import eos_id

    eos = run.data_meta.get("eos_id")
    if eos is None:
        eos = eos_id(tokenizer)
    token = tokenizer.id_to_token(int(eos))
    if token is None:
        raise DataError(f"{run.tokenizer_path}: EOS id {eos} is not in the vocabulary")
    return {name: (token, int(eos)) for name in ("eos", "bos", "pad")}


def write_tokenizer(run: Run, out: Path) -> dict[str, tuple[str, int]]:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(run.tokenizer_path))
    specials = special_tokens(run, raw)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        model_max_length=run.model.max_seq_len,
        padding_side="right",  # the remote-code model refuses left padding
        **{f"{name}_token": token for name, (token, _) in specials.items()},
    )
    fast.save_pretrained(out)
    return specials


def write_model(run: Run, out: Path, specials: dict[str, tuple[str, int]]) -> str:
    """config.json + model.safetensors (+ remote code); returns the transformers class name."""
    from safetensors.torch import load_file, save_file

    state = load_file(run.run_dir / "model.safetensors")
    ids = {f"{name}_token_id": i for name, (_, i) in specials.items()}
    if is_plain_llama(run.model, run.arch):
        from transformers import LlamaConfig

        config = LlamaConfig(**llama_config_kwargs(run.model), **ids)
        config.architectures = ["LlamaForCausalLM"]
        tensors, class_name = to_llama_state_dict(state, run.model), "LlamaForCausalLM"
    else:
        from depthbench.hf.remote_code.configuration_depthbench import DepthBenchConfig

        config = DepthBenchConfig(depthbench_model=run.model.to_dict(), **ids)
        config.architectures = ["DepthBenchForCausalLM"]
        config.auto_map = {
            "AutoConfig": "configuration_depthbench.DepthBenchConfig",
            "AutoModelForCausalLM": "modeling_depthbench.DepthBenchForCausalLM",
        }
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE_CODE / name, out / name)
        tensors, class_name = {PREFIX + k: v for k, v in state.items()}, "DepthBenchForCausalLM"
    config.dtype = torch.float32
    config.save_pretrained(out)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return class_name


def write_generation_config(out: Path, specials: dict[str, tuple[str, int]], remote: bool) -> None:
    from transformers import GenerationConfig

    # No KV cache in the remote-code model: each step reruns the sequence.
    GenerationConfig(
        eos_token_id=specials["eos"][1],
        bos_token_id=specials["bos"][1],
        pad_token_id=specials["pad"][1],
        do_sample=False,
        max_new_tokens=64,
        use_cache=not remote,
    ).save_pretrained(out)


def export_run(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    results_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> dict:
    """Write the export of `run_dir` to `out_dir` (built in a temporary folder beside it and
    renamed into place, so a failed export leaves nothing half-written)."""
    run = load_run(run_dir, results_dir)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(
            "OUT_DIR", f"{out} exists and is not empty; pass --overwrite or choose a new folder"
        )
    with atomic_folder(out) as tmp:
        specials = write_tokenizer(run, tmp)
        class_name = write_model(run, tmp, specials)
        # a folder without the remote-code config.json (see above)
        if class_name != "LlamaForCausalLM":
            write_tokenizer(run, tmp / TOKENIZER_FOLDER)
        write_generation_config(tmp, specials, remote=class_name != "LlamaForCausalLM")
        (tmp / "README.md").write_text(model_card(run, class_name))
    return {
        "run_id": run.spec["run_id"],
        "arch": run.arch,
        "class": class_name,
        "out_dir": str(out),
    }
