"""transformers configuration of a DepthBench model exported with `depthbench export`.

Copied verbatim into every non-Llama export (loaded with `trust_remote_code=True`). The
DepthBench `ModelConfig` is kept whole under `depthbench_model`; the usual transformers
attributes (hidden_size, num_hidden_layers, ...) mirror it for tools that read them.
"""

from transformers import PretrainedConfig


class DepthBenchConfig(PretrainedConfig):
    model_type = "depthbench"

    def __init__(self, depthbench_model=None, **kwargs):
        model = dict(depthbench_model or {})
        self.depthbench_model = model
        # Mirrors of the ModelConfig fields, under transformers' names (informative: the model is
        # built from depthbench_model only).
        self.vocab_size = model.get("vocab_size")
        self.hidden_size = model.get("d_model")
        self.num_hidden_layers = model.get("n_layer")
        self.num_attention_heads = model.get("n_head")
        self.num_key_value_heads = model.get("n_kv_head")
        self.intermediate_size = model.get("d_ff")
        self.max_position_embeddings = model.get("max_seq_len")
        self.rms_norm_eps = model.get("norm_eps")
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
