"""The model card (README.md) of an export: architecture, budget, data, recipe, final losses.

Everything comes from the run's summary.json (its RunSpec and results) and the data folder's
meta.json; a value the run did not record is written as "n/a", never guessed.
"""

from __future__ import annotations

import math


def _fmt(value, spec: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def _loading(class_name: str) -> str:
    if class_name == "LlamaForCausalLM":
        return (
            "A plain `LlamaForCausalLM` (DepthBench's pre_ln is Llama): no remote code.\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(path)\n"
            "tokenizer = AutoTokenizer.from_pretrained(path)\n```\n"
        )
    return (
        "DepthBench's own `DecoderLM` behind transformers' interface "
        "(`modeling_depthbench.py`): it needs the `depthbench` package installed beside "
        "transformers. Importing `depthbench.hf.auto` registers its classes, so the model and "
        "the tokenizer load from this folder with no remote code and no prompt. Token ids "
        "only, right padding only, no KV cache (generation reruns the sequence each step).\n\n"
        "```python\nimport depthbench.hf.auto  # registers DepthBench with the Auto classes\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(path)\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)\n```\n\n"
        "Without that import: `AutoModelForCausalLM.from_pretrained(path, "
        "trust_remote_code=True)` runs this folder's copy of the code, and "
        '`AutoTokenizer.from_pretrained(path + "/tokenizer")` loads the tokenizer alone '
        "(from `path` itself transformers would first ask whether to run the code).\n"
    )


def model_card(run, class_name: str) -> str:
    """Markdown text of the card for `run` (a depthbench.hf.export.Run)."""
    from depthbench.models.registry import declared_options  # the options this architecture reads

    spec, summary, cfg, meta = run.spec, run.summary, run.model, run.data_meta
    train = spec["train"]
    corpus = meta.get("corpus", {})
    shape = spec.get("shape", {})
    lines = [
        "---",
        "library_name: transformers",
        f"tags: [depthbench, {run.arch}]",
        "---",
        f"# DepthBench run `{spec['run_id']}`",
        "",
        "## Architecture",
        f"- residual architecture: **{run.arch}**; transformers class `{class_name}`",
        f"- L = {cfg.n_layer} layers, d_model = {cfg.d_model}, d_ff = {cfg.d_ff}, "
        f"{cfg.n_head} heads ({cfg.n_kv_head} K/V heads), head_dim {cfg.head_dim}, "
        f"vocabulary {cfg.vocab_size}, context {cfg.max_seq_len}",
        f"- RMSNorm eps {cfg.norm_eps}, RoPE theta {cfg.rope_theta}, untied embeddings, no biases",
        f"- arch_options: {declared_options(run.arch, cfg.arch_options) or 'none'}; "
        f"MoE: {cfg.moe or 'none (dense SwiGLU)'}",
        "",
        "## Budget",
        f"- parameters: {_fmt(summary.get('n_params'), ',')} as trained "
        f"(the shape's count: {_fmt(shape.get('n_params'), ',')}); "
        f"d_model / L = {cfg.d_model / cfg.n_layer:.1f}; knobs: {spec.get('knobs') or 'none'}",
        f"- tokens seen: {_fmt(summary.get('tokens_seen'), ',')} "
        f"in {_fmt(summary.get('steps'))} steps "
        f"({train.get('tokens_per_param')} tokens per parameter requested)",
        "",
        "## Data",
        f"- corpus: {corpus.get('name', 'n/a')} (source {corpus.get('source', 'n/a')}), "
        f"data id `{spec['data_id']}`, "
        f"tokenizer id `{spec['tokenizer_id']}`",
        f"- training tokens available: {_fmt(meta.get('train', {}).get('n_tokens'), ',')}; "
        f"validation tokens: {_fmt(meta.get('val', {}).get('n_tokens'), ',')}",
        f"- licence: {meta.get('licence', 'n/a')}",
        "",
        "## Recipe",
        f"- AdamW, lr {spec['lr']}, betas ({train.get('beta1')}, {train.get('beta2')}), "
        f"eps {train.get('adam_eps')}, "
        f"weight decay {train.get('weight_decay')}, gradient clip {train.get('grad_clip')}",
        f"- linear warm-up over {train.get('warmup_fraction')} of the steps, "
        f"cosine decay to {train.get('min_lr_ratio')} x lr",
        f"- global batch {train.get('global_batch_size')} x {train.get('seq_len')} tokens, "
        f"seed {spec['seed']}, "
        f"init std {cfg.init_std}, dtype {train.get('dtype')}",
        "",
        "## Final losses (nats per token)",
        f"- validation: {_fmt(summary.get('final_val_loss'), '.4f')}",
        f"- last logged training loss: {_fmt(run.last_train_loss, '.4f')}",
        "",
        "## Loading",
        _loading(class_name),
    ]
    return "\n".join(lines) + "\n"
