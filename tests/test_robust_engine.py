"""What vLLM users combine with speculation, each exact against plain decoding (or
refused with a message), through one DSpine engine with dynamic verification (the
default), its cost model injected (engine_utils.TINY_INJECTED_COST: the policy verifies
lengths that vary by request and step as with the measured model, but not with the
machine's load), and one plain engine over the same tiny pair (both from the session's
registry, conftest.py: shared with tests/test_dynamic_engine.py and the other modules of
the tiny pair).

Covered: structured outputs (regex, JSON schema, choice), n > 1, logprobs,
prompt_logprobs, stop strings, max_tokens 1 and 2 (zero or one draft position),
prompts at max_model_len - 1 and a few tokens before it, and a random batch fuzzer
(temperature 0-2, top-k, top-p, min-p, penalties, seeds, stops, lengths). Greedy in
float32 is compared token for token; seeded sampled requests must reproduce. Sampled
distributions are tested in tests/test_exact_distribution.py.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from engine_utils import TINY_INJECTED_COST, dspine_spec, prompts_of_lengths

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def pair(tiny_trained_pair):
    return tiny_trained_pair  # conftest.py: written once per session


@pytest.fixture
def plain_llm(engines, pair):
    return engines.get(pair.target_dir, max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def spec_llm(engines, pair):
    return engines.get(pair.target_dir,
                       dspine_spec(pair.draft_dir, dspine_verify_cost=TINY_INJECTED_COST),
                       max_model_len=MAX_MODEL_LEN)


def _tokens(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def _texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


# ------------------------------------------------------------- structured outputs
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "size": {"enum": ["s", "m", "l"]}},
    "required": ["color", "size"],
    "additionalProperties": False,
}
GRAMMARS = [
    pytest.param({"regex": r"[a-z]{3,8}(-[a-z]{2,6}){1,2}"}, id="regex"),
    pytest.param({"json": SCHEMA, "disable_any_whitespace": True}, id="json-schema"),
    pytest.param({"choice": ["apple pie", "banana split", "cherry tart"]}, id="choice"),
]


def _json_answers() -> set[str]:
    """Every text SCHEMA admits, written without whitespace (either key order)."""
    out = set()
    for c in SCHEMA["properties"]["color"]["enum"]:
        for z in SCHEMA["properties"]["size"]["enum"]:
            out.add(json.dumps({"color": c, "size": z}, separators=(",", ":")))
            out.add(json.dumps({"size": z, "color": c}, separators=(",", ":")))
    return out


def _valid(kind: dict, text: str, finished: bool) -> bool:
    """A finished output is a complete answer of the grammar; one cut by max_tokens is
    a prefix of one (only the JSON grammar, whose whitespace is unbounded, runs long)."""
    if "regex" in kind:
        return finished and re.fullmatch(kind["regex"], text) is not None
    if "choice" in kind:
        return finished and text in kind["choice"]
    compact = re.sub(r"\s", "", text)  # the schema's strings hold no whitespace
    if finished:
        return compact in _json_answers() and json.loads(text) is not None
    return any(a.startswith(compact) for a in _json_answers())


@pytest.mark.parametrize("kind", GRAMMARS)
def test_structured_outputs(plain_llm, spec_llm, kind):
    """Under a grammar, greedy output equals plain decoding under the same grammar, and
    seeded sampled outputs (T 1) are always valid (complete, or for the JSON grammar,
    whose whitespace the random target can draw for ever, a prefix of a valid answer
    when cut by max_tokens). Drafts the grammar rejects are cut by vLLM's scheduler
    before verification."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts = prompts_of_lengths(12, longest=120)
    so = StructuredOutputsParams(**kind)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so)
    want = _tokens(plain_llm.generate(prompts, greedy))
    got = _tokens(spec_llm.generate(prompts, greedy))
    assert got == want
    sampled = [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=64,
                              structured_outputs=StructuredOutputsParams(**kind))
               for i in range(len(prompts))]
    outs = spec_llm.generate(prompts, sampled)
    for o in outs:
        c = o.outputs[0]
        assert _valid(kind, c.text, c.finish_reason == "stop"), (c.text, c.finish_reason)
    finished = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    assert finished == len(outs) if "json" not in kind else finished >= 1, finished
    assert len(set(_texts(outs))) > 1  # sampling did vary


# --------------------------------------------------------- request-level features
def test_n_greater_than_one(spec_llm):
    """n = 4: seeded sampled children reproduce and differ from each other; greedy
    n > 1 is refused by vLLM itself, with its message (as without speculation)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    prompts = prompts_of_lengths(4, longest=80)
    with pytest.raises(VLLMValidationError, match="n must be 1 when using greedy"):
        SamplingParams(n=4, temperature=0.0, max_tokens=40)
    sampled = SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    a = spec_llm.generate(prompts, sampled)
    b = spec_llm.generate(prompts, sampled)
    assert _tokens(a) == _tokens(b)
    assert all(len({tuple(c.token_ids) for c in o.outputs}) > 1 for o in a)


def _close_logprobs(a, b, atol=1e-3):
    """Position by position: the same token ids with logprobs within atol."""
    assert len(a) == len(b)
    for pa, pb in zip(a, b):
        if pa is None or pb is None:
            assert pa is None and pb is None
            continue
        assert set(pa) == set(pb), (pa, pb)
        for t in pa:
            assert abs(pa[t].logprob - pb[t].logprob) < atol, (t, pa[t], pb[t])
            assert pa[t].rank == pb[t].rank


def test_logprobs_and_prompt_logprobs_match_plain(plain_llm, spec_llm):
    """logprobs=5 and prompt_logprobs=3, greedy: the sampled token's logprob and the
    top 5 at every generated position (accepted drafts included) equal plain
    decoding's, and so do the prompt's."""
    from vllm import SamplingParams

    prompts = prompts_of_lengths(6, longest=100)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5,
                        prompt_logprobs=3)
    want = plain_llm.generate(prompts, sp)
    got = spec_llm.generate(prompts, sp)
    for w, g in zip(want, got):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
        _close_logprobs(g.outputs[0].logprobs, w.outputs[0].logprobs)
        _close_logprobs(g.prompt_logprobs, w.prompt_logprobs)


def test_stop_strings_and_stop_tokens(plain_llm, spec_llm):
    """A stop string taken from the middle of each plain continuation: speculation
    accepts several tokens past it in one step, and the output must still end exactly
    where plain decoding's does (text and tokens)."""
    from vllm import SamplingParams

    prompts = prompts_of_lengths(8, longest=100)
    free = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    texts = _texts(plain_llm.generate(prompts, free))
    params = []
    for i, t in enumerate(texts):
        mid = t[10 + i:13 + i]
        assert len(mid) == 3
        params.append(SamplingParams(temperature=0.0, max_tokens=48, stop=[mid],
                                     ignore_eos=True))
    want = plain_llm.generate(prompts, params)
    got = spec_llm.generate(prompts, params)
    assert _tokens(got) == _tokens(want) and _texts(got) == _texts(want)
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    stop_ids = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                               stop_token_ids=[list(w.outputs[0].token_ids)[12]])
                for w in want]
    assert _tokens(spec_llm.generate(prompts, stop_ids)) == \
        _tokens(plain_llm.generate(prompts, stop_ids))


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_max_tokens_one_and_two(plain_llm, spec_llm, max_tokens):
    """max_tokens 1 (no draft position) and 2 (one): exact, and exactly that long,
    greedy and seeded sampled."""
    from vllm import SamplingParams

    prompts = prompts_of_lengths(10, longest=100)
    for sp in (SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
               SamplingParams(temperature=0.9, seed=3, max_tokens=max_tokens,
                              ignore_eos=True)):
        got = _tokens(spec_llm.generate(prompts, sp))
        assert all(len(t) == max_tokens for t in got)
        if sp.temperature == 0:
            assert got == _tokens(plain_llm.generate(prompts, sp))
        else:
            assert got == _tokens(spec_llm.generate(prompts, sp))


@pytest.mark.parametrize("prompt_len", [MAX_MODEL_LEN - 1, MAX_MODEL_LEN - 20])
def test_prompts_at_the_end_of_the_context(plain_llm, spec_llm, prompt_len):
    """A prompt of max_model_len - 1 tokens (one token fits) and one 20 short of it
    (the drafter's block no longer fits before the end: vLLM stops drafting): greedy
    equals plain decoding and stops at max_model_len, in a batch with short prompts."""
    from vllm import SamplingParams, TokensPrompt

    long_ids = [32 + (7 * i) % 90 for i in range(prompt_len)]
    prompts = [TokensPrompt(prompt_token_ids=long_ids)] + \
        [TokensPrompt(prompt_token_ids=list(s.encode())) for s in prompts_of_lengths(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = plain_llm.generate(prompts, sp)
    got = spec_llm.generate(prompts, sp)
    assert _tokens(got) == _tokens(want)
    assert len(got[0].outputs[0].token_ids) == MAX_MODEL_LEN - prompt_len
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="maximum context length is 512"):
        too_long = long_ids + [40] * (MAX_MODEL_LEN + 5 - prompt_len)
        spec_llm.generate([TokensPrompt(prompt_token_ids=too_long)], sp)


# -------------------------------------------------------------------- fuzzer
def _random_params(rng: random.Random, i: int):
    from vllm import SamplingParams

    greedy = rng.random() < 0.35
    kw = dict(max_tokens=rng.choice([1, 2, 3, 8, 17, 33, 64]), ignore_eos=rng.random() < 0.7)
    if rng.random() < 0.3:
        kw.update(repetition_penalty=rng.choice([0.8, 1.2, 1.5]))
    if rng.random() < 0.3:
        kw.update(frequency_penalty=rng.choice([-0.5, 0.5, 1.0]),
                  presence_penalty=rng.choice([-0.5, 0.0, 0.8]))
    if rng.random() < 0.2:
        kw.update(stop=[rng.choice(["e ", "th", "q", "ox"])])
    if greedy:
        return SamplingParams(temperature=0.0, **kw), "greedy"
    kw.update(temperature=rng.choice([0.1, 0.5, 1.0, 1.5, 2.0]))
    if rng.random() < 0.5:
        kw.update(top_k=rng.choice([1, 3, 20, 100]))
    if rng.random() < 0.5:
        kw.update(top_p=rng.choice([0.3, 0.8, 0.95]))
    if rng.random() < 0.3:
        kw.update(min_p=rng.choice([0.02, 0.2]))
    seeded = rng.random() < 0.6
    if seeded:
        kw.update(seed=10_000 + i)
    return SamplingParams(**kw), "seeded" if seeded else "random"


def test_batch_fuzzer(plain_llm, spec_llm):
    """Four rounds of 32 requests with random mixtures of everything above (and
    prompts of 3..300 tokens): no crash; greedy members (penalties and stops included)
    equal plain decoding; seeded members reproduce when the round is run again;
    every output respects its max_tokens and stop string."""
    rng = random.Random(1234)
    base = prompts_of_lengths(64, longest=300)
    for rnd in range(4):
        prompts = [base[rng.randrange(len(base))] for _ in range(32)]
        drawn = [_random_params(rng, 32 * rnd + i) for i in range(32)]
        params = [d[0] for d in drawn]
        first = spec_llm.generate(prompts, params, use_tqdm=False)
        again = spec_llm.generate(prompts, params, use_tqdm=False)
        greedy_idx = [i for i, d in enumerate(drawn) if d[1] == "greedy"]
        plain = plain_llm.generate([prompts[i] for i in greedy_idx],
                                   [params[i] for i in greedy_idx], use_tqdm=False)
        for i, w in zip(greedy_idx, plain):
            assert list(first[i].outputs[0].token_ids) == list(w.outputs[0].token_ids), \
                (rnd, i, params[i])
        for i, (o, sp) in enumerate(zip(first, params)):
            c = o.outputs[0]
            assert len(c.token_ids) <= sp.max_tokens, (rnd, i, sp)
            if sp.stop:
                assert not any(s in c.text for s in sp.stop), (rnd, i, sp, c.text)
            if drawn[i][1] == "seeded":
                assert list(c.token_ids) == list(again[i].outputs[0].token_ids), \
                    (rnd, i, sp)
