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


# ------------------------------------------------------------ real targets, via vLLM
def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of `prompt` as one user turn, with the generation prompt (the chat
    template rendered to text, then encoded without adding special tokens again)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_llm(target_dir: str, max_model_len: int, max_num_seqs: int = 32):
    """A plain vLLM engine on the target (no speculation), fp32 on CPU."""
    from vllm import LLM

    return LLM(target_dir, dtype="float32", enforce_eager=True, max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, seed=0)


SELF_PROMPT_OPENERS = ("Write", "How do I", "Explain", "What is", "Can you", "Give me",
                       "Implement", "Why does", "Show me", "Create", "Describe", "Fix")


def generate_self_prompts(llm, tokenizer, num: int, seed: int, max_tokens: int = 48,
                          topics: tuple[str, ...] = ()) -> list[str]:
    """User turns the target writes itself: it is given only the opening of a user turn
    (the chat template up to the user's first words) and samples at temperature 1.0.
    With `topics`, turn i opens with "About <topic>: " before its opener word, so the
    turns spread over the topics instead of the target's favourite few.
    Kept: one-line results of 4..60 words that end like a request or a question."""
    from vllm import SamplingParams

    openers = SELF_PROMPT_OPENERS
    stub = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}],
                                         tokenize=False).split("\x00")[0]
    if topics:
        openers = tuple(f"About {topics[(i * 7 + seed) % len(topics)]}: "
                        f"{SELF_PROMPT_OPENERS[i % len(SELF_PROMPT_OPENERS)]}"
                        for i in range(num))
    texts = [stub + openers[i % len(openers)] for i in range(num)]
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens,
                             seed=seed * 1_000_003 + i, stop=["\n", "<|im_end|>"])
              for i in range(num)]
    outs = llm.generate(texts, params, use_tqdm=False)
    prompts = []
    for i, o in enumerate(outs):
        text = (openers[i % len(openers)] + o.outputs[0].text).strip()
        words = len(text.split())
        if 4 <= words <= 60 and text[-1:] in ".?":
            prompts.append(text)
    return prompts


def generate_answers(llm, tokenizer, prompts: list[str], max_tokens: int,
                     greedy_share: float, temperature: float, seed: int
                     ) -> list[list[int]]:
    """The target's answers to chat-templated `prompts`: the first round(greedy_share * n)
    greedy, the rest sampled at `temperature` (top-p 0.95, per-prompt seeds).
    -> per prompt, prompt ids + answer ids (the text the drafter is trained on)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n_greedy = round(greedy_share * len(prompts))
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens) if i < n_greedy else
              SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens,
                             seed=seed * 1_000_003 + i)
              for i in range(len(prompts))]
    ids = [chat_ids(tokenizer, p) for p in prompts]
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params,
                        use_tqdm=True)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def padded_batches(seqs, batch_tokens: int):
    """Sequences of similar length batched for one forward each: right-padded (causal
    attention keeps the padding out of real positions), at most `batch_tokens` padded
    tokens per batch (a longer sequence alone).
    -> yields (indices of the batch's sequences, ids [n, T])"""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    i = 0
    while i < len(order):
        T = len(seqs[order[i]])
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max(batch_tokens, T):
            j += 1
        group = order[i:j]
        T = max(len(seqs[g]) for g in group)
        ids = torch.zeros(len(group), T, dtype=torch.long)
        for r, g in enumerate(group):
            ids[r, :len(seqs[g])] = torch.as_tensor(seqs[g])
        yield group, ids
        i = j


@torch.no_grad()
def features_of_sequences(model, seqs: list[list[int]], layer_ids: tuple[int, ...],
                          batch_tokens: int = 4096, progress=None) -> list[torch.Tensor]:
    """Target features of every position of every sequence.  -> per sequence [T, F*H]
    (batched by `padded_batches`)."""
    out: list[torch.Tensor | None] = [None] * len(seqs)
    for group, ids in padded_batches(seqs, batch_tokens):
        feats = target_features(model, ids, layer_ids)  # [n, T, F*H]
        for r, g in enumerate(group):
            out[g] = feats[r, :len(seqs[g])].clone()
        if progress is not None:
            progress(sum(len(seqs[g]) for g in group))
    return out  # type: ignore[return-value]
