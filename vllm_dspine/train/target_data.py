"""Text and features from the target itself, for distillation (transformers, fp32).

- `generate_text`: prompts continued by the target, greedy or sampled from one seeded
  generator (the tiny pair's prompts are random printable bytes).
- Target features: the residual stream after each decoder layer in `target_layer_ids`
  (what vLLM hands the drafter: the un-normalised `hidden + residual` after layer i).
  Caution: transformers' `output_hidden_states[i + 1]` is that for every layer but the
  last, whose entry has the final norm applied; forward hooks read the layer outputs.

    S sequences, T sequence length, F target feature layers, H hidden, V vocabulary.
"""

from __future__ import annotations

import contextlib

import torch

# Printable ASCII: the tiny pair's prompt alphabet (its planted habit cycles through it).
_PRINTABLE_LO, _PRINTABLE_HI = 32, 127


def load_target(target_dir: str):
    """The target as a transformers model, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def generate_text(model, num_seqs: int, prompt_len: int, new_tokens: int,
                  greedy_share: float, gen: torch.Generator,
                  temperature: float = 1.0) -> torch.Tensor:
    """Random printable prompts continued by the target.  -> ids [S, prompt_len + new_tokens]

    The first round(greedy_share * S) sequences are greedy, the rest sampled at
    `temperature` (plain softmax, no filtering) from `gen`. Every position, the last
    included, goes through the target once (so hooks see the features of all T).
    """
    ids = torch.randint(_PRINTABLE_LO, _PRINTABLE_HI, (num_seqs, prompt_len),
                        generator=gen)  # [S, P]
    greedy = torch.arange(num_seqs) < round(greedy_share * num_seqs)  # [S]
    out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    steps = [ids]
    for _ in range(new_tokens):
        logits = out.logits[:, -1].float()  # [S, V]
        sampled = torch.multinomial((logits / temperature).softmax(-1), 1,
                                    generator=gen)[:, 0]  # [S]
        nxt = torch.where(greedy, logits.argmax(-1), sampled)[:, None]  # [S, 1]
        steps.append(nxt)
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return torch.cat(steps, dim=1)


@contextlib.contextmanager
def _capture_layer_outputs(model, layer_ids: tuple[int, ...]):
    """Collect each listed decoder layer's output of every forward call, in call order.

    Yields {layer id: list of [S, t, H] fp32 chunks}. transformers' Qwen3 decoder layer
    returns the residual stream after the layer (un-normalised): vLLM's auxiliary output.
    """
    taken: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
    layers = model.model.layers
    hooks = []
    for i in layer_ids:
        def hook(_mod, _inp, out, i=i):
            taken[i].append((out[0] if isinstance(out, tuple) else out).float())
        hooks.append(layers[i].register_forward_hook(hook))
    try:
        yield taken
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def generate_with_features(model, layer_ids: tuple[int, ...], *args, **kwargs
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`generate_text` that also returns the features of every position, read while
    generating (every token, the last one included, goes through the target once).

    -> ids [S, T], features [S, T, F*H]
    """
    with _capture_layer_outputs(model, layer_ids) as taken:
        ids = generate_text(model, *args, **kwargs)
    feats = torch.cat([torch.cat(taken[i], dim=1) for i in layer_ids], dim=-1)
    assert feats.shape[:2] == ids.shape, (feats.shape, ids.shape)
    return ids, feats


@torch.no_grad()
def target_features(model, ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Residual stream after each listed decoder layer, concatenated.  -> [S, T, F*H]

    Read with forward hooks: `output_hidden_states` normalises the last layer's entry.
    """
    with _capture_layer_outputs(model, layer_ids) as taken:
        model(input_ids=ids, use_cache=False)
    return torch.cat([taken[i][0] for i in layer_ids], dim=-1)
