"""Distillation prompts available offline, with no benchmark data among them.

The drafter learns what the target itself writes, so the prompts only need to make the
target write the kind of text users ask it for (code first: HumanEval-style function
completions are the measured workload). Sources, all on this machine:

- `stdlib_function_prompts`: for functions of Python's standard library, a HumanEval-
  shaped task (signature + the first paragraph of the docstring, "complete this
  function"), an "explain with an example" question and a "write a function that ..."
  instruction. HumanEval itself is test data and never used here.
- `self_prompts`: user turns the target writes itself when given only the opening of a
  user turn (sampled), e.g. "How do I ...". Made by `target_data.generate_self_prompts`.
- `doc_prompts`: paragraphs of this project's docs to summarise or explain.

Every source is deterministic for a seed; `mixed_prompts` interleaves them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import random
import re

# Modules whose public functions make varied, well-documented tasks (no side effects at
# import, pure-Python signatures readable by `inspect`).
STDLIB_MODULES = (
    "bisect", "heapq", "textwrap", "string", "statistics", "itertools", "functools",
    "operator", "collections", "json", "re", "fnmatch", "glob", "shlex", "difflib",
    "base64", "binascii", "hashlib", "html", "urllib.parse", "os.path", "posixpath",
    "calendar", "datetime", "fractions", "decimal", "random", "math", "cmath", "copy",
    "pprint", "reprlib", "enum", "dataclasses", "csv", "configparser", "argparse",
    "ipaddress", "uuid", "zlib", "gzip", "shutil", "tempfile", "pathlib", "typing",
    "inspect", "ast", "tokenize", "keyword", "unicodedata", "locale", "gettext",
    "colorsys", "wave", "quopri", "email.utils", "mimetypes", "http.cookies",
    "secrets", "contextlib", "abc", "numbers", "array", "struct", "codecs", "io",
    "time", "sched", "queue", "threading", "logging", "warnings", "traceback",
    "linecache", "filecmp", "zipfile", "tarfile", "plistlib", "xml.sax.saxutils",
    "graphlib", "weakref", "types", "platform", "sysconfig", "getopt", "optparse",
)

CODE_TEMPLATES = (
    "Complete the following Python function.\n\n```python\n{stub}\n```",
    "{stub}",
    "Write the body of this Python function:\n\n{stub}",
)
EXPLAIN_TEMPLATES = (
    "What does `{qual}` do in Python? Show a short example.",
    "Explain `{qual}{sig}` and give an example of when to use it.",
)
WRITE_TEMPLATES = (
    "Write a Python function `{name}{sig}` that does the following: {summary}",
    "Implement {summary_lc} in Python, without using `{qual}`.",
)


def _summary(doc: str) -> str:
    """The first paragraph of a docstring, on one line."""
    para = doc.strip().split("\n\n")[0]
    return re.sub(r"\s+", " ", para).strip()


def _stub(name: str, sig: str, doc: str) -> str:
    """A HumanEval-shaped stub: signature and an indented docstring, no body."""
    body = textwrap_indent(doc.strip())
    return f'def {name}{sig}:\n    """{body}\n    """\n'


def textwrap_indent(text: str) -> str:
    lines = text.splitlines()
    return "\n".join([lines[0]] + ["    " + ln if ln.strip() else "" for ln in lines[1:]])


def stdlib_functions() -> list[tuple[str, str, str, str]]:
    """(qualified name, name, signature, docstring) of documented stdlib functions."""
    out = []
    for mod_name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40 or len(doc) > 1500:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            if "<" in sig:  # defaults that print as objects
                continue
            out.append((f"{mod_name}.{name}", name, sig, doc))
    return out


def stdlib_function_prompts(seed: int = 0) -> list[str]:
    """Three prompts per documented stdlib function: complete, explain, write."""
    rng = random.Random(seed)
    prompts = []
    for qual, name, sig, doc in stdlib_functions():
        summary = _summary(doc)
        stub = _stub(name, sig, doc)
        prompts.append(rng.choice(CODE_TEMPLATES).format(stub=stub))
        prompts.append(rng.choice(EXPLAIN_TEMPLATES).format(qual=qual, sig=sig))
        prompts.append(rng.choice(WRITE_TEMPLATES).format(
            name=name, sig=sig, summary=summary, qual=qual,
            summary_lc=summary[:1].lower() + summary[1:].rstrip(".")))
    rng.shuffle(prompts)
    return prompts


def doc_prompts(docs_dir: str, seed: int = 0) -> list[str]:
    """Paragraphs of the project's docs (>= 200 characters) to summarise or explain."""
    rng = random.Random(seed)
    out = []
    if not os.path.isdir(docs_dir):
        return out
    for fname in sorted(os.listdir(docs_dir)):
        if not fname.endswith(".md"):
            continue
        with open(os.path.join(docs_dir, fname)) as f:
            paras = [p.strip() for p in f.read().split("\n\n")]
        for p in paras:
            if len(p) >= 200 and not p.startswith("|"):
                ask = rng.choice(("Summarise this in two sentences:", "Explain this to a "
                                  "new engineer:", "Rewrite this more simply:"))
                out.append(f"{ask}\n\n{p[:1200]}")
    rng.shuffle(out)
    return out


def mixed_prompts(sources: list[list[str]], limit: int, seed: int = 0) -> list[str]:
    """Round-robin over the sources (each already shuffled), de-duplicated, at most
    `limit`, in a seeded order."""
    seen, out = set(), []
    iters = [iter(s) for s in sources]
    while iters and len(out) < limit:
        for it in list(iters):
            p = next(it, None)
            if p is None:
                iters.remove(it)
                continue
            if p not in seen:
                seen.add(p)
                out.append(p)
                if len(out) >= limit:
                    break
    random.Random(seed).shuffle(out)
    return out


# ------------------------------------------- keyed sources of the growing corpus
# (`train/corpus.py`): each item is (provenance key, prompt), in a seeded order.

# Topics for the self-written user turns: general chat well beyond code.
CHAT_TOPICS = (
    "cooking", "travel planning", "personal finance", "fitness", "gardening", "history",
    "physics", "chemistry", "biology", "astronomy", "geography", "music", "film",
    "literature", "poetry", "writing an email", "a job interview", "career advice",
    "studying for an exam", "mathematics homework", "statistics", "economics",
    "philosophy", "psychology", "parenting", "pets", "home repair", "cars",
    "photography", "painting", "languages", "grammar", "a birthday party", "a wedding speech",
    "a short story", "a product description", "marketing", "a business plan",
    "time management", "sleep", "nutrition", "mental health", "climate", "energy",
    "JavaScript", "SQL", "Rust", "shell scripting", "Git", "Linux", "web development",
    "data analysis with pandas", "machine learning", "regular expressions", "algorithms",
    "data structures", "unit testing", "debugging a Python error", "APIs", "databases",
    "networking", "security", "cloud computing", "spreadsheets", "a resume",
    "a cover letter", "a recipe", "a travel itinerary", "a workout plan", "board games",
)

DEBIAN_TEMPLATES = (
    "What is the Debian package `{pkg}` for? Its description says: {short}.",
    "I just installed `{pkg}` ({short}). How do I get started with it?",
    "Explain to a beginner what this software does: {short}.",
    "Summarise this package description in plain words:\n\n{long}",
    "When would I use `{pkg}` instead of an alternative? It is described as: {short}.",
)


def debian_packages(limit: int | None = None) -> list[tuple[str, str, str]]:
    """(package, short description, long description) of the packages `apt-cache
    dumpavail` lists on this machine (empty where apt-cache is missing), one entry per
    distinct short description (the -data/-doc/-dev siblings repeat their main one)."""
    import subprocess

    try:
        text = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True,
                              timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    out, seen = [], set()
    for stanza in text.split("\n\n"):
        pkg = short = None
        long_lines: list[str] = []
        in_desc = False
        for line in stanza.splitlines():
            if line.startswith("Package: "):
                pkg = line[9:].strip()
            elif line.startswith("Description: "):
                short, in_desc = line[13:].strip(), True
            elif in_desc and line.startswith(" "):
                long_lines.append("" if line.strip() == "." else line.strip())
            else:
                in_desc = False
        if not pkg or not short or short.lower() in seen:
            continue
        seen.add(short.lower())
        out.append((pkg, short.rstrip("."), " ".join(long_lines).strip()[:1200]))
    out.sort()
    return out[:limit] if limit else out


def debian_prompts(seed: int = 0) -> list[tuple[str, str]]:
    """One prompt per Debian package description (template drawn per package)."""
    rng = random.Random(seed)
    out = []
    for pkg, short, long in debian_packages():
        t = rng.choice(DEBIAN_TEMPLATES if len(long) >= 200 else DEBIAN_TEMPLATES[:3]
                       + DEBIAN_TEMPLATES[4:])
        out.append((f"debian:{pkg}", t.format(pkg=pkg, short=short, long=long)))
    rng.shuffle(out)
    return out


PYDOC_TEMPLATES = (
    "Explain this part of the Python language reference with a short example:\n\n{text}",
    "Summarise this Python documentation for a beginner:\n\n{text}",
    "Write a small Python program that demonstrates this:\n\n{text}",
)


def python_prompts(seed: int = 0) -> list[tuple[str, str]]:
    """Standard-library function tasks (`stdlib_function_prompts`) and chunks of the
    Python reference topics that ship with Python (`pydoc_data.topics`)."""
    rng = random.Random(seed)
    out = [(f"stdlib:{i}", p) for i, p in enumerate(stdlib_function_prompts(seed))]
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for name in sorted(topics):
        paras = [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) >= 200]
        for j, p in enumerate(paras):
            out.append((f"pydoc:{name}:{j}",
                        rng.choice(PYDOC_TEMPLATES).format(text=p[:1200])))
    rng.shuffle(out)
    return out
