"""The working sets of a training step beside its saved activations, for the memory estimate
(depthbench.train.memory): the loss's, and the worst moment of a step of one micro-batch, whose
gradients do not exist before its backward."""

from __future__ import annotations

FP32 = 4


def single_micro_batch_peak(
    saved: float,
    unit_saved: list,
    unit_frees: list,
    unit_gradients: list,
    gradients: float,
    loss_working: float,
    held_working: float,
    shard: int = 1,
    in_flight: float = 0.0,
) -> float:
    """Bytes above weights and AdamW's moments (and FSDP2's gathered parameters, DDP's buckets) at
    the worst moment of a step of one micro-batch without checkpointing, whose gradients do not
    exist before its backward (set to None after the previous step). Backward runs from the loss
    through the units, last first. `gradients` counts every gradient whole.

    - Before the first unit: every saved tensor, the gradients of the parameters outside the
      units (the head's and the final norm's come first; the embedding's last, all counted here)
      and the larger of the loss's and the held buffers' working sets.
    - While unit u is differentiated: the saved tensors not yet freed (a storage is freed once
      every unit saving it is done, never while a part outside the units saves it too:
      `unit_frees[u]`, the bytes freed after unit u), the gradients made so far (outside and
      units v >= u: `unit_gradients`), unit u's working set (its saved bytes again) and the held
      buffers' (their readers' gradients wait for their producers' backward).
    - After the last unit: every gradient.

    Under FSDP2 (`shard` ranks) a unit's gradients are reduce-scattered once it is done: the
    units done count a `shard`-th of theirs, and while a unit is differentiated `in_flight` bytes
    (its unsharded gradients and the reduce-scatter's fp32 copy of them) count beside them; the
    root's (outside the units) stay unsharded to the end of backward, where the reduce-scatter
    copies them too. On one rank (`shard` 1, `in_flight` 0) every gradient made counts whole.
    The tests hold it to a GPU's measured steps (tests/data/h200_training_step_memory.json)."""
    outside = gradients - sum(unit_gradients)
    moments = [saved + outside + max(loss_working, held_working)]
    freed, made = 0.0, outside
    for u in reversed(range(len(unit_saved))):
        made += unit_gradients[u] / shard
        moments.append(saved - freed + made + in_flight + unit_saved[u] + held_working)
        freed += unit_frees[u]
    moments.append(made + in_flight + (outside if shard > 1 else 0.0))
    return max(moments)


def loss_working_bytes(tokens: int, vocab: int, d_model: int, chunk: int, bf16: bool) -> float:
    """The loss's tensors that live beside the saved activations, at their largest.

    Plain loss (`chunk` 0, or at least `tokens`, as DecoderLM falls back to it): at the start of
    backward the fp32 gradient of the log-probabilities and that of the logits, (tokens, V) each,
    exist together (the forward's bf16 and fp32 logits, 6 bytes a value, are fewer).
    Chunked loss (depthbench.models.loss): in the forward, one chunk's fp32 logits (softmaxed in
    place), their scaled gradient in fp32 and, under bf16, its bf16 copy: 8 or 10 bytes a value;
    beside them the head's weight in bf16, its gradient product and that product in fp32 (4
    bytes a weight in fp32, 8 under bf16). Its backward scales d x and d W into new tensors
    (tokens x d and V x d, fp32), fewer at every shape of the presets but counted too."""
    if chunk <= 0 or chunk >= tokens:
        return 2.0 * tokens * vocab * FP32
    per_logit, per_weight = (10, 8) if bf16 else (8, 4)
    forward = chunk * vocab * per_logit + vocab * d_model * per_weight
    backward = (tokens + vocab) * d_model * FP32
    return float(max(forward, backward))
