"""The file of a drafter's lookup corpus (`lookup_corpus.npz` in the drafter folder):
the target's own answers that DSpine's corpus lookup copies drafts from
(`proposer/corpus_lookup.py`, docs/lookup.md "The corpus lookup").

    tokens: [N] every answer's token ids, each followed by the separator (the dtype's
            largest value: uint16 where the ids allow, else int32)
    num_answers: how many answers
"""

from __future__ import annotations

import os

import numpy as np

LOOKUP_CORPUS_FILE = "lookup_corpus.npz"


def write_lookup_corpus(answers: list[np.ndarray], path: str) -> dict:
    """Store the target's answers (token ids) as one lookup corpus (written to a
    temporary name, then renamed: never torn). Returns {"answers", "tokens"}."""
    top = max((int(np.max(a)) for a in answers if len(a)), default=0)
    dtype = np.uint16 if top < np.iinfo(np.uint16).max else np.int32
    sep = np.iinfo(dtype).max
    parts = []
    for a in answers:
        parts += [np.asarray(a, dtype=dtype), np.array([sep], dtype=dtype)]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    tmp = path + ".partial.npz"
    np.savez_compressed(tmp, tokens=tokens, num_answers=np.int64(len(answers)))
    os.replace(tmp, path)
    return {"answers": len(answers), "tokens": int(tokens.shape[0]) - len(answers)}


def read_lookup_corpus(path: str) -> np.ndarray:
    """The `tokens` array of a lookup corpus file; a clear error for anything else."""
    try:
        with np.load(path) as z:
            tokens = z["tokens"]
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(
            f"{path} is not a DSpine lookup corpus ({e}); write one with "
            f"`python -m vllm_dspine.train.lookup_corpus` (docs/lookup.md) or set "
            f"'dspine_lookup_corpus': false") from e
    if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.int32):
        raise ValueError(f"{path} is not a DSpine lookup corpus: its tokens are "
                         f"{tokens.dtype} of shape {tuple(tokens.shape)}, not 1-D uint16 "
                         f"or int32; write it again with `python -m "
                         f"vllm_dspine.train.lookup_corpus`")
    return tokens


def resolve_lookup_corpus(given, draft_dir: str) -> str | None:
    """The file `speculative_config['dspine_lookup_corpus']` asks for: None for false or
    left out (the default), the drafter folder's file for true, else the path given;
    refused by name where it is missing or not a lookup corpus (checked at start, in
    the front end, before an engine is built)."""
    if given is None or given is False:
        return None
    path = given if isinstance(given, str) else os.path.join(draft_dir, LOOKUP_CORPUS_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"speculative_config['dspine_lookup_corpus'] = {given!r}: no lookup corpus at "
            f"{path}; write one with `python -m vllm_dspine.train.lookup_corpus --corpus "
            f"CORPUS_DIR --out {path}` (docs/lookup.md), or remove the key")
    read_lookup_corpus(path)
    return path
