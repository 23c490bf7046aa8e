"""Plain-PyTorch replacements for vLLM CPU ops that are wrong or slow on CPU.

Each function computes what the vLLM op it stands for computes, in the same argument
order, and nothing else: no vLLM import here. `plugin/patches/cpu_kernels.py` puts them
in vLLM's place (rows `cpu-expand-kernel`, `cpu-grouped-rms-norm` and
`cpu-causal-conv1d-fp32` of `plugin/patches/table.py`, which say why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expand_to_tokens_cpu(
    output: torch.Tensor,  # [num_tokens]
    input_val: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size]  inclusive cumulative counts
    replace_from,
    replace_to,
) -> None:
    """expanded[start_i:end_i] = (x_i == replace_from ? replace_to : x_i), in place,
    in `output`'s own dtype. E.g. x = [a, b, c], cu = [2, 5, 6] -> [a, a, b, b, b, c]."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    expanded = values.to(output.dtype).repeat_interleave(counts)
    output[: expanded.shape[0]].copy_(expanded)


def grouped_rms_norm_cpu(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                         epsilon: float) -> None:
    """out[g, ...] = rms_norm(input[g, ...]) * weight[g]  for weight [G, D], input
    [G, ..., D]."""
    x = input.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)).to(input.dtype)
    w = weight.view(weight.shape[0], *([1] * (input.ndim - 2)), weight.shape[1])
    out.copy_(normed * w.to(input.dtype))


def causal_conv1d_fp32_cpu(x, weight, bias, conv_states, query_start_loc,
                           cache_indices=None, has_initial_state=None, activation="silu",
                           *, pad_slot_id: int):
    """vLLM's `causal_conv1d_fn_cpu`: x [D, T] (sequences at query_start_loc),
    weight [D, W], conv_states [slots, D, >= W - 1] read as initial windows and left
    holding each sequence's last W - 1 inputs. Each output is the sum of the W taps in
    fp32, rounded to the weight's dtype and then x's (as vLLM's conv in the weight's
    dtype), then SiLU; sequences of no tokens or on `pad_slot_id` are skipped."""
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal conv1d: activation {activation!r} is not None/silu/swish")
    x_dtype = x.dtype
    x = x.to(conv_states.dtype)
    out = torch.empty_like(x)  # [D, T]
    D, W = weight.shape
    taps = weight.float()[:, None, :]  # [D, 1, W]
    bias32 = None if bias is None else bias.float()[:, None]  # [D, 1]
    starts = query_start_loc.tolist()
    slots = None if cache_indices is None else cache_indices.tolist()
    initial = None if has_initial_state is None else has_initial_state.tolist()
    for i in range(len(starts) - 1):
        bos, eos = starts[i], starts[i + 1]
        slot = i if slots is None else slots[i]
        if bos == eos or slot == pad_slot_id:
            continue
        if initial is not None and initial[i]:
            window = conv_states[slot, :, :W - 1]  # [D, W-1]
        else:
            window = torch.zeros(D, W - 1, dtype=x.dtype)
        conv_input = torch.cat([window, x[:, bos:eos]], dim=-1).to(weight.dtype)  # [D, W-1+L]
        y = (conv_input.float().unfold(1, W, 1) * taps).sum(-1)  # [D, L]
        if bias32 is not None:
            y += bias32
        y = y.to(weight.dtype).to(x.dtype)
        out[:, bos:eos] = F.silu(y) if activation is not None else y
        conv_states[slot, :, :W - 1].copy_(conv_input[:, -(W - 1):])
    return out.to(x_dtype)
