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
# Where a self-written user turn ends (vLLM's `stop`; the transformers engine cuts there).
SELF_PROMPT_STOPS = ("\n", "<|im_end|>")


def _self_prompt_openers(num: int, seed: int, topics: tuple[str, ...]) -> list[str]:
    """The first words of self-written turn i (with `topics`: "About <topic>: <opener>")."""
    if not topics:
        return [SELF_PROMPT_OPENERS[i % len(SELF_PROMPT_OPENERS)] for i in range(num)]
    return [f"About {topics[(i * 7 + seed) % len(topics)]}: "
            f"{SELF_PROMPT_OPENERS[i % len(SELF_PROMPT_OPENERS)]}" for i in range(num)]


def _user_turn_stub(tokenizer) -> str:
    """The chat template up to a user's first words."""
    return tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}],
                                         tokenize=False).split("\x00")[0]


def _kept_self_prompts(openers: list[str], continuations: list[str]) -> list[str]:
    """Kept: one-line results of 4..60 words that end like a request or a question."""
    prompts = []
    for opener, cont in zip(openers, continuations):
        text = (opener + cont).strip()
        words = len(text.split())
        if 4 <= words <= 60 and text[-1:] in ".?":
            prompts.append(text)
    return prompts


def generate_self_prompts(llm, tokenizer, num: int, seed: int, max_tokens: int = 48,
                          topics: tuple[str, ...] = ()) -> list[str]:
    """User turns the target writes itself: it is given only the opening of a user turn
    (the chat template up to the user's first words) and samples at temperature 1.0,
    top-p 0.95. With `topics`, turn i opens with "About <topic>: " before its opener
    word, so the turns spread over the topics instead of the target's favourite few.
    `llm`: a vLLM engine (`make_llm`) or a `TransformersEngine`."""
    openers = _self_prompt_openers(num, seed, topics)
    texts = [_user_turn_stub(tokenizer) + o for o in openers]
    if isinstance(llm, TransformersEngine):
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        outs = llm.generate(ids, max_tokens, [1.0] * num, seed)
        conts = []
        for o in outs:
            text = tokenizer.decode(o)
            for stop in SELF_PROMPT_STOPS:
                text = text.split(stop)[0]
            conts.append(text)
        return _kept_self_prompts(openers, conts)
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens,
                             seed=seed * 1_000_003 + i, stop=list(SELF_PROMPT_STOPS))
              for i in range(num)]
    outs = llm.generate(texts, params, use_tqdm=False)
    return _kept_self_prompts(openers, [o.outputs[0].text for o in outs])


def generate_answers(llm, tokenizer, prompts: list[str], max_tokens: int,
                     greedy_share: float, temperature: float, seed: int
                     ) -> list[list[int]]:
    """The target's answers to chat-templated `prompts`: the first round(greedy_share * n)
    greedy, the rest sampled at `temperature` (top-p 0.95; vLLM: per-prompt seeds).
    `llm`: a vLLM engine (`make_llm`) or a `TransformersEngine`.
    -> per prompt, prompt ids + answer ids (the text the drafter is trained on)."""
    n_greedy = round(greedy_share * len(prompts))
    temps = [0.0 if i < n_greedy else temperature for i in range(len(prompts))]
    ids = [chat_ids(tokenizer, p) for p in prompts]
    if isinstance(llm, TransformersEngine):
        return [x + y for x, y in zip(ids, llm.generate(ids, max_tokens, temps, seed))]
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens) if t == 0.0 else
              SamplingParams(temperature=t, top_p=0.95, max_tokens=max_tokens,
                             seed=seed * 1_000_003 + i)
              for i, t in enumerate(temps)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params,
                        use_tqdm=True)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


class TransformersEngine:
    """The target through transformers on any torch device, batched with a KV cache: what
    writes corpus shards where vLLM is not installed (a GPU machine with torch alone).

    The same sampling as the vLLM path: greedy (argmax) or temperature then top-p 0.95
    (no top-k), an answer ends after its first end-of-sequence token (kept, as vLLM
    keeps it) or at `max_tokens`. Not the same random draws: one seeded generator per
    batch instead of vLLM's per-request seeds. fp32 without TF32 (the target's numbers).
    """

    def __init__(self, target_dir: str, device: str = "cpu", batch_size: int = 256):
        from transformers import AutoTokenizer

        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        self.model = load_target(target_dir).to(self.device)
        tok = AutoTokenizer.from_pretrained(target_dir)
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else tok.eos_token_id
        self.eos = torch.tensor(eos if isinstance(eos, list) else [eos], device=self.device)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else int(self.eos[0])
        self.batch_size = batch_size

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: int, temperatures: list[float],
                 seed: int) -> list[list[int]]:
        """New tokens after each prompt (left-padded batches of similar length)."""
        out: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for b, at in enumerate(range(0, len(order), self.batch_size)):
            rows = order[at:at + self.batch_size]
            gen = torch.Generator(self.device).manual_seed(seed * 1_000_003 + b)
            new = self._batch([prompts[i] for i in rows], max_tokens,
                              torch.tensor([temperatures[i] for i in rows],
                                           device=self.device), gen)
            for i, tokens in zip(rows, new):
                out[i] = tokens
        return out

    def _batch(self, prompts: list[list[int]], max_tokens: int,
               temps: torch.Tensor,  # [B]  0: greedy
               gen: torch.Generator) -> list[list[int]]:
        B, P = len(prompts), max(len(p) for p in prompts)
        dev = self.device
        ids = torch.full((B, P), self.pad, dtype=torch.long, device=dev)  # [B, P]
        mask = torch.zeros(B, P, dtype=torch.long, device=dev)  # [B, P]
        for r, p in enumerate(prompts):  # left padding: every last prompt token at P - 1
            ids[r, P - len(p):] = torch.as_tensor(p, device=dev)
            mask[r, P - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]  each prompt from position 0
        cache = None
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # [B]
        steps = []
        x = ids
        for _ in range(max_tokens):
            o = self.model(input_ids=x, attention_mask=mask, position_ids=pos,
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = o.past_key_values
            nxt = self._sample(o.logits[:, -1].float(), temps, gen)  # [B]
            nxt = torch.where(done, torch.full_like(nxt, self.pad), nxt)
            steps.append(torch.where(done, torch.full_like(nxt, -1), nxt))
            done |= torch.isin(nxt, self.eos)
            if bool(done.all()):
                break
            x = nxt[:, None]
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], dim=1)
            pos = pos[:, -1:] + 1
        new = torch.stack(steps, dim=1).cpu()  # [B, n]  -1 after the end
        return [[int(t) for t in row if t >= 0] for row in new]

    @staticmethod
    def _sample(logits: torch.Tensor,  # [B, V]
                temps: torch.Tensor,  # [B]
                gen: torch.Generator, top_p: float = 0.95) -> torch.Tensor:
        greedy = logits.argmax(-1)  # [B]
        probs = torch.softmax(logits / temps.clamp(min=1e-6)[:, None], dim=-1)
        sp, si = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always)
        drop = (sp.cumsum(-1) - sp) >= top_p
        sp = sp.masked_fill(drop, 0.0)
        pick = torch.multinomial(sp, 1, generator=gen)[:, 0]
        sampled = si.gather(1, pick[:, None])[:, 0]
        return torch.where(temps > 0, sampled, greedy)


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
