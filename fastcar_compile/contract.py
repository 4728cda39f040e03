"""The exported-decoder I/O contract that the compiler reads (SPEC.md section 4, docs/DESIGN.md)."""

from __future__ import annotations


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Graph input and output names of a decoder with KV cache, as exporters are asked to write them."""
    ins = ["input_ids", "attention_mask", "position_ids"]
    outs = ["logits"]
    for i in range(num_layers):
        ins += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outs += [f"present.{i}.key", f"present.{i}.value"]
    return ins, outs
