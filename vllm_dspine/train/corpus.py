"""The distillation corpus: the target's own answers, stored as compact shards that grow.

    python -m vllm_dspine.train.corpus --target DIR --corpus data/corpus/smollm2 --shards 4

A shard is one `shard-NNNNN.npz` (numpy, compressed; ~2 bytes a token) holding, per
sequence, the chat-templated prompt ids followed by the target's answer ids, where the
answer starts, the prompt's source and key (provenance), and the sampling setting the
answer was drawn with. `manifest.json` beside the shards lists them with their counts.
The command adds shards until `--shards` exist and never touches a finished one, so the
corpus grows run after run (a stopped run loses at most the shard it was writing).

Prompt sources, all offline and none a benchmark (HumanEval is test data, never a
prompt; `train/prompts.py` has the generators):

- `self`: user turns the target writes itself from an opening and a topic (general chat),
- `debian`: Debian package descriptions from `apt-cache dumpavail` (what a tool is for,
  how to start with it, a summary of its description),
- `python`: standard-library function tasks and Python reference topics (`pydoc_data`),
- `docs`: paragraphs of this project's docs.

Shard k takes its share of each static source's k-th slice (seeded order, fixed for the
corpus), so shards never repeat a prompt; prompts already in an earlier shard (same
text) are skipped, and the self-written turns are drawn with seed k.

    n sequences in a shard, N tokens in all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

SOURCES = ("self", "debian", "python", "docs",
           # held-out only (never trained on): the benchmarks' own prompts
           "humaneval", "bench-chat")
TRAIN_SOURCES = SOURCES[:4]
# Share of each source in a shard: general chat (self + debian) well represented, code
# (python) as the measured workload, the project's docs a little (they run out first;
# the others then fill the shard).
SHARES = {"self": 0.35, "debian": 0.25, "python": 0.30, "docs": 0.10}
SHARD_FORMAT = 1


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompt_hash(prompt: str) -> str:
    return hashlib.sha1(prompt.encode()).hexdigest()[:16]


# ------------------------------------------------------------------- reading shards
class Corpus:
    """The shards of one corpus folder, read back as token sequences.

    sequences: per sequence the prompt + answer ids (list of np.int64 arrays);
    answer_start: the first answer position of each; source / key / temperature: per
    sequence provenance and sampling setting."""

    def __init__(self, folder: str, shards: list[str] | None = None):
        self.folder = folder
        manifest = read_manifest(folder)
        names = shards if shards is not None else [s["file"] for s in manifest["shards"]]
        self.sequences: list[np.ndarray] = []
        self.answer_start: list[int] = []
        self.source: list[str] = []
        self.key: list[str] = []
        self.temperature: list[float] = []
        self.shard_of: list[str] = []
        for name in names:
            with np.load(os.path.join(folder, name)) as z:
                tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
                for i in range(len(offsets) - 1):
                    self.sequences.append(tokens[offsets[i]:offsets[i + 1]])
                self.answer_start += z["answer_start"].tolist()
                self.source += [SOURCES[s] for s in z["source"].tolist()]
                self.key += z["key"].tolist()
                self.temperature += z["temperature"].tolist()
                self.shard_of += [name] * (len(offsets) - 1)

    def __len__(self) -> int:
        return len(self.sequences)

    def answers(self) -> list[np.ndarray]:
        """Each sequence's answer (its tokens from `answer_start` on)."""
        return [s[a:] for s, a in zip(self.sequences, self.answer_start)]

    def answer_tokens(self) -> int:
        return int(sum(len(s) - a for s, a in zip(self.sequences, self.answer_start)))

    def token_ids(self) -> np.ndarray:
        """Every token id the sequences hold, sorted (the codebook rows training saw)."""
        return np.unique(np.concatenate(self.sequences)).astype(np.int64)


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, "manifest.json")
    if not os.path.exists(path):
        return {"format": SHARD_FORMAT, "shards": []}
    with open(path) as f:
        return json.load(f)


def first_shards(folder: str, n: int | None = None) -> list[str]:
    """The file names of a corpus's shards in the order they were added; the first `n`
    when given (`--shards N`: the same N shards for features and training)."""
    names = [s["file"] for s in read_manifest(folder)["shards"]]
    return names if n is None else names[:n]


# ------------------------------------------------------------------- vocabulary coverage
def coverage_vocab(token_lists, coverage: float, vocab_size: int):
    """The most frequent tokens until `coverage` of all tokens is covered.  -> sorted [V']
    (torch int64: the drafter's loss and retrieval vocabulary)."""
    import torch

    counts = np.zeros(vocab_size, dtype=np.int64)
    for t in token_lists:
        counts += np.bincount(np.asarray(t), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")
    cum = np.cumsum(counts[order]) / counts.sum()
    n = int(np.searchsorted(cum, coverage) + 1)
    return torch.from_numpy(np.sort(order[:n])).long()


def covered_share(token_lists, vocab, vocab_size: int) -> float:
    """Share of all tokens of `token_lists` that lie inside `vocab` (ids)."""
    inside = np.zeros(vocab_size, dtype=bool)
    inside[np.asarray(vocab)] = True
    tot = sum(len(t) for t in token_lists)
    return float(sum(inside[np.asarray(t)].sum() for t in token_lists) / max(1, tot))


def coverage_growth(folder: str, held_out: str, vocab_size: int,
                    coverage: float = 0.995) -> list[dict]:
    """How the corpus's vocabulary covers held-out answers as shards are added: per
    prefix of the shards, the answer tokens, the ids the corpus holds, the share of the
    held-out answer tokens they cover, and the same for the `coverage` loss vocabulary
    the trainer would choose (`python -m vllm_dspine.train --vocab-coverage`)."""
    held = Corpus(held_out)
    held_answers = held.answers()
    rows, seqs, answer_tokens = [], [], 0
    for n, shard in enumerate(read_manifest(folder)["shards"], start=1):
        c = Corpus(folder, [shard["file"]])  # each shard read once, the prefix grows
        seqs += c.sequences
        answer_tokens += c.answer_tokens()
        seen = np.unique(np.concatenate(seqs))
        vocab = coverage_vocab(seqs, coverage, vocab_size)
        rows.append({"shards": n, "answer_tokens": answer_tokens, "ids": int(seen.size),
                     "held_out_covered": covered_share(held_answers, seen, vocab_size),
                     "loss_vocab": int(vocab.numel()),
                     "loss_vocab_covers": covered_share(held_answers, vocab, vocab_size)})
    return rows


def _write_manifest(folder: str, manifest: dict) -> None:
    tmp = os.path.join(folder, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(folder, "manifest.json"))


def write_shard(folder: str, name: str, seqs: list[list[int]], answer_start: list[int],
                source: list[str], key: list[str], temperature: list[float],
                vocab_size: int) -> dict:
    """One shard file (written to a temporary name, then renamed: never torn)."""
    assert len(seqs) == len(answer_start) == len(source) == len(key) == len(temperature)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    tmp = os.path.join(folder, name + ".tmp.npz")
    np.savez_compressed(
        tmp, tokens=np.concatenate([np.asarray(s, dtype=dtype) for s in seqs]),  # [N]
        offsets=offsets,  # [n + 1]
        answer_start=np.asarray(answer_start, dtype=np.int32),  # [n]
        source=np.asarray([SOURCES.index(s) for s in source], dtype=np.uint8),  # [n]
        key=np.asarray(key, dtype=str),  # [n]
        temperature=np.asarray(temperature, dtype=np.float32),  # [n]
        prompt_sha1=np.asarray([k.split("#")[-1] for k in key], dtype=str))  # [n]
    os.replace(tmp, os.path.join(folder, name))
    return {"file": name, "sequences": len(seqs), "tokens": int(offsets[-1]),
            "answer_tokens": int(sum(len(s) - a for s, a in zip(seqs, answer_start))),
            "by_source": {s: source.count(s) for s in SOURCES if s in source}}


# ------------------------------------------------------------------ making a shard
def parse_shares(text: str) -> dict[str, float]:
    """`self=0.6,debian=0.15,python=0.2,docs=0.05` -> {source: share}: every training
    source named once, shares >= 0 summing to 1."""
    shares: dict[str, float] = {}
    for part in text.split(","):
        src, _, val = part.partition("=")
        src = src.strip()
        if src not in TRAIN_SOURCES or src in shares:
            raise ValueError(f"--shares: {src!r} is not a training source named once; "
                             f"name each of {', '.join(TRAIN_SOURCES)} once, e.g. "
                             f"self=0.6,debian=0.15,python=0.2,docs=0.05")
        try:
            shares[src] = float(val)
        except ValueError:
            raise ValueError(f"--shares: {src}={val!r} is not a number") from None
        if shares[src] < 0:
            raise ValueError(f"--shares: {src}={val} is negative")
    missing = [src for src in TRAIN_SOURCES if src not in shares]
    if missing or abs(sum(shares.values()) - 1.0) > 1e-6:
        raise ValueError(f"--shares: give every source ({', '.join(TRAIN_SOURCES)}), "
                         f"shares summing to 1 (missing {missing or 'none'}, sum "
                         f"{sum(shares.values()):g})")
    return shares


def shard_prompts(k: int, n: int, static: dict[str, list[tuple[str, str]]],
                  self_written: list[tuple[str, str]], seen: set[str],
                  shares: dict[str, float] | None = None) -> list[tuple[str, str, str]]:
    """Shard k's prompts: `shares` (default SHARES) of n from each source's k-th slice
    (static sources) or from this shard's self-written turns; a source that runs short
    leaves its place to the others (round-robin). Prompts whose hash is in `seen` are
    skipped.  -> [(source, key, prompt)]"""
    shares = shares or SHARES
    pools: dict[str, list[tuple[str, str]]] = {"self": self_written}
    for src, items in static.items():
        per = max(1, round(shares[src] * n))
        pools[src] = items[k * per:(k + 1) * per] + items[(k + 1) * per:]  # spill-over tail
    out: list[tuple[str, str, str]] = []
    quota = {s: round(shares[s] * n) for s in TRAIN_SOURCES}
    iters = {s: iter(pools.get(s, [])) for s in TRAIN_SOURCES}

    def take(src: str) -> bool:
        for key, prompt in iters[src]:
            h = prompt_hash(prompt)
            if h in seen:
                continue
            seen.add(h)
            out.append((src, f"{key}#{h}", prompt))
            return True
        return False

    for src in TRAIN_SOURCES:  # each source up to its share
        while quota[src] > 0 and len(out) < n and take(src):
            quota[src] -= 1
    live = list(TRAIN_SOURCES)
    while len(out) < n and live:  # the rest: whoever still has prompts
        for src in list(live):
            if len(out) >= n:
                break
            if not take(src):
                live.remove(src)
    return out


def build_shard(llm, tokenizer, k: int, n: int, static, seen: set[str], max_tokens: int,
                greedy_share: float, temperature: float, seed: int,
                shares: dict[str, float] | None = None):
    """Prompts of shard k and the target's answers to them (vLLM, one batch)."""
    from vllm_dspine.train import prompts as P
    from vllm_dspine.train.target_data import (chat_ids, generate_answers,
                                               generate_self_prompts)

    shares = shares or SHARES
    want_self = round(shares["self"] * n * 1.6)  # about 60 % of sampled turns are kept
    turns = generate_self_prompts(llm, tokenizer, want_self, seed=seed * 1000 + k,
                                  topics=P.CHAT_TOPICS)
    self_written = [(f"self:{k}:{i}", t) for i, t in enumerate(turns)]
    chosen = shard_prompts(k, n, static, self_written, seen, shares)
    prompts = [p for _, _, p in chosen]
    seqs = generate_answers(llm, tokenizer, prompts, max_tokens, greedy_share,
                            temperature, seed * 1000 + k)
    n_greedy = round(greedy_share * len(prompts))
    temps = [0.0 if i < n_greedy else temperature for i in range(len(prompts))]
    starts = [len(chat_ids(tokenizer, p)) for p in prompts]
    return seqs, starts, [s for s, _, _ in chosen], [key for _, key, _ in chosen], temps


def static_prompts(seed: int = 0, docs_dir: str | None = None
                   ) -> dict[str, list[tuple[str, str]]]:
    """The static sources' prompts in their seeded order: {source: [(key, prompt)]}."""
    from vllm_dspine.train import prompts as P

    docs_dir = docs_dir or os.path.join(os.path.dirname(__file__), "..", "..", "docs")
    return {"debian": P.debian_prompts(seed), "python": P.python_prompts(seed),
            "docs": [(f"docs:{i}", p) for i, p in enumerate(P.doc_prompts(docs_dir, seed))]}


def make_engine(target_dir: str, engine: str, device: str, max_num_seqs: int):
    """vLLM (`make_llm`, this machine's build) or transformers on `device` (a machine
    without vLLM, a GPU's: `TransformersEngine`)."""
    from vllm_dspine.train.target_data import TransformersEngine, make_llm

    if engine == "vllm":
        return make_llm(target_dir, max_model_len=2048, max_num_seqs=max_num_seqs)
    if engine == "transformers":
        return TransformersEngine(target_dir, device, batch_size=max_num_seqs)
    raise ValueError(f"--engine {engine!r}: choose vllm or transformers")


def grow(target_dir: str, folder: str, shards: int, prompts_per_shard: int,
         max_tokens: int = 256, greedy_share: float = 0.75, temperature: float = 0.7,
         seed: int = 0, max_num_seqs: int = 64, docs_dir: str | None = None,
         engine: str = "vllm", device: str = "cpu", static_file: str | None = None,
         shares: dict[str, float] | None = None) -> dict:
    """Add shards to `folder` until it holds `shards` of them; finished shards are kept
    as they are. `static_file`: the static sources' prompts as `--write-static-prompts`
    wrote them (another machine's Debian lists and Python differ); `shares`: each
    source's share of a new shard (default SHARES; recorded in the shard's entry where
    it differs). -> the manifest"""
    from transformers import AutoTokenizer

    os.makedirs(folder, exist_ok=True)
    manifest = read_manifest(folder)
    have = len(manifest["shards"])
    if have >= shards:
        _log(f"{folder}: {have} shards already, nothing to add")
        return manifest
    tok = AutoTokenizer.from_pretrained(target_dir)
    seen = set()
    for s in manifest["shards"]:
        with np.load(os.path.join(folder, s["file"])) as z:
            seen.update(z["prompt_sha1"].tolist())
    if static_file:
        with open(static_file) as f:
            static = {k: [tuple(x) for x in v] for k, v in json.load(f).items()}
    else:
        static = static_prompts(seed, docs_dir)
    _log(f"static sources: " + ", ".join(f"{k} {len(v)}" for k, v in static.items()))
    llm = make_engine(target_dir, engine, device, max_num_seqs)
    manifest.setdefault("target", os.path.basename(os.path.abspath(target_dir)))
    manifest.setdefault("settings", {"max_tokens": max_tokens, "greedy_share": greedy_share,
                                     "temperature": temperature, "top_p": 0.95,
                                     "seed": seed, "prompts_per_shard": prompts_per_shard})
    for k in range(have, shards):
        t0 = time.time()
        seqs, starts, source, key, temps = build_shard(
            llm, tok, k, prompts_per_shard, static, seen, max_tokens, greedy_share,
            temperature, seed, shares)
        entry = write_shard(folder, f"shard-{k:05d}.npz", seqs, starts, source, key, temps,
                            len(tok))
        if shares and shares != SHARES:
            entry["shares"] = shares
        entry.update(seconds=round(time.time() - t0, 1), date=time.strftime("%Y-%m-%d"),
                     engine=engine if engine == "vllm" else f"{engine} ({device})")
        manifest["shards"].append(entry)
        _write_manifest(folder, manifest)
        _log(f"shard {k}: {entry}")
    return manifest


def held_out_shard(target_dir: str, folder: str, prompts_file: str, max_tokens: int = 256,
                   max_num_seqs: int = 64, engine: str = "vllm", device: str = "cpu") -> dict:
    """A corpus of one greedy shard from given prompts (JSON lines of {"source", "key",
    "prompt"}, sources `humaneval` / `bench-chat`): held-out text whose prompts come from
    sources training never sees. -> the manifest"""
    from transformers import AutoTokenizer

    from vllm_dspine.train.target_data import chat_ids, generate_answers

    os.makedirs(folder, exist_ok=True)
    manifest = read_manifest(folder)
    if manifest["shards"]:
        return manifest
    with open(prompts_file) as f:
        items = [json.loads(line) for line in f if line.strip()]
    bad = sorted({it["source"] for it in items} - set(SOURCES[4:]))
    if bad:
        raise ValueError(f"{prompts_file}: held-out sources must be one of {SOURCES[4:]}, "
                         f"got {bad}")
    tok = AutoTokenizer.from_pretrained(target_dir)
    llm = make_engine(target_dir, engine, device, max_num_seqs)
    prompts = [it["prompt"] for it in items]
    seqs = generate_answers(llm, tok, prompts, max_tokens, 1.0, 0.0, 0)
    entry = write_shard(folder, "shard-00000.npz", seqs,
                        [len(chat_ids(tok, p)) for p in prompts],
                        [it["source"] for it in items],
                        [f"{it['key']}#{prompt_hash(it['prompt'])}" for it in items],
                        [0.0] * len(items), len(tok))
    manifest.update(target=os.path.basename(os.path.abspath(target_dir)),
                    settings={"max_tokens": max_tokens, "greedy_share": 1.0,
                              "prompts_file": os.path.basename(prompts_file)},
                    shards=[entry])
    _write_manifest(folder, manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dspine.train.corpus",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the target's Hugging Face folder")
    ap.add_argument("--corpus", required=True, help="the corpus folder (shards, manifest)")
    ap.add_argument("--shards", type=int, default=None,
                    help="grow the corpus to this many shards")
    ap.add_argument("--held-out-prompts", default=None,
                    help="instead: one greedy held-out shard from these prompts (JSON lines "
                         "of source/key/prompt; `python bench/held_out_prompts.py` writes them)")
    ap.add_argument("--prompts-per-shard", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--greedy-share", type=float, default=0.75)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="sequences generated at once (vLLM's max_num_seqs; the "
                         "transformers engine's batch)")
    ap.add_argument("--engine", choices=["vllm", "transformers"], default="vllm",
                    help="vllm (default), or transformers on --device where vLLM is not "
                         "installed (a GPU machine with torch alone)")
    ap.add_argument("--device", default="cpu", help="--engine transformers: torch device")
    ap.add_argument("--static-prompts", default=None, metavar="FILE",
                    help="read the static sources' prompts from FILE (written here by "
                         "--write-static-prompts) instead of this machine's lists")
    ap.add_argument("--write-static-prompts", default=None, metavar="FILE",
                    help="instead: write the static sources' prompts to FILE and stop")
    ap.add_argument("--shares", default=None, metavar="SRC=X,...",
                    help="each source's share of a new shard, e.g. "
                         "self=0.6,debian=0.15,python=0.2,docs=0.05 (default "
                         + ",".join(f"{k}={v:g}" for k, v in SHARES.items()) + ")")
    ap.add_argument("--coverage-of", default=None, metavar="HELD_OUT",
                    help="instead: print how the corpus's vocabulary covers the answers of "
                         "the held-out corpus HELD_OUT as shards are added (no engine)")
    args = ap.parse_args(argv)
    try:
        shares = parse_shares(args.shares) if args.shares else None
    except ValueError as e:
        ap.error(str(e))
    if args.write_static_prompts:
        static = static_prompts(args.seed)
        with open(args.write_static_prompts, "w") as f:
            json.dump(static, f)
        _log(f"{args.write_static_prompts}: " +
             ", ".join(f"{k} {len(v)}" for k, v in static.items()))
        return 0
    if args.coverage_of:
        with open(os.path.join(args.target, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        print("| shards | answer tokens | ids in corpus | held-out answers covered "
              "| 99.5 % loss vocabulary | it covers |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in coverage_growth(args.corpus, args.coverage_of, vocab_size):
            print(f"| {r['shards']} | {r['answer_tokens']:,} | {r['ids']:,} "
                  f"| {100 * r['held_out_covered']:.1f} % | {r['loss_vocab']:,} "
                  f"| {100 * r['loss_vocab_covers']:.1f} % |")
        return 0
    from vllm_dspine.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    if args.held_out_prompts:
        m = held_out_shard(args.target, args.corpus, args.held_out_prompts, args.max_tokens,
                           args.max_num_seqs, args.engine, args.device)
        _log(f"held-out corpus: {m['shards'][0]}")
        return 0
    if args.shards is None:
        ap.error("--shards N (grow the corpus) or --held-out-prompts FILE is required")
    m = grow(args.target, args.corpus, args.shards, args.prompts_per_shard, args.max_tokens,
             args.greedy_share, seed=args.seed, max_num_seqs=args.max_num_seqs,
             engine=args.engine, device=args.device, static_file=args.static_prompts,
             shares=shares)
    total = sum(s["answer_tokens"] for s in m["shards"])
    _log(f"{len(m['shards'])} shards, {total} answer tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
