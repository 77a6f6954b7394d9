"""Register DepthBench's transformers classes with the Auto classes, in this process.

    import depthbench.hf.auto  # noqa: F401  (the import registers)
    model = AutoModelForCausalLM.from_pretrained(path)   # no trust_remote_code, no prompt
    tokenizer = AutoTokenizer.from_pretrained(path)

Why: a remote-code export's config.json names its configuration class in `auto_map`, and
transformers' `AutoTokenizer.from_pretrained(path)` loads that configuration before the
tokenizer files, so without `trust_remote_code` it asks on stdin whether to run the export's
code (a scripted caller gets a timeout and an error). transformers skips the question when the
config's `model_type` has a local class: registering "depthbench" here makes the classes of
depthbench/hf/remote_code the local ones (the same source the export copies), so both the
tokenizer and the model load from the export's own folder without remote code. With
`trust_remote_code=True`, transformers still runs the export's copy instead.

The registration is process-wide and idempotent; an export also keeps the tokenizer alone in
`tokenizer/`, which loads without this import (depthbench.hf.export).
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from depthbench.hf.remote_code.configuration_depthbench import DepthBenchConfig
from depthbench.hf.remote_code.modeling_depthbench import DepthBenchForCausalLM


def register() -> None:
    """AutoConfig["depthbench"] = DepthBenchConfig and AutoModelForCausalLM[DepthBenchConfig] =
    DepthBenchForCausalLM, once (transformers refuses a second registration of a name)."""
    if DepthBenchConfig.model_type not in CONFIG_MAPPING:
        AutoConfig.register(DepthBenchConfig.model_type, DepthBenchConfig)
    if DepthBenchConfig not in AutoModelForCausalLM._model_mapping:
        AutoModelForCausalLM.register(DepthBenchConfig, DepthBenchForCausalLM)


register()
