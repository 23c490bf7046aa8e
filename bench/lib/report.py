"""What every benchmark writes beside its numbers, and the tables of engine rows.

- `machine()`, `version()`, `git_rev()`: the facts of a table's header (one writer, so
  that every table names the machine alike);
- `replace_section(doc, section, body)`: a script's section of docs/benchmarks.md
  (`DOC`) between its markers;
- `engine_tables(rows)`, `engine_plots(rows, img_dir)`: the markdown tables and PNG
  plots of the rows `bench.lib.engines.Engine.measure` returns (bench/e2e.py's report).
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import platform
import re
import statistics
import subprocess

from bench.lib.engines import K

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "benchmarks.md"
IMG = REPO / "docs" / "img"


def machine() -> str:
    """The benchmarks' "Machine:" line: cores, CPU model (from /proc/cpuinfo), and the
    GPU where there is one; one writer, so that every table names the machine alike."""
    from vllm_dspine.cpu_env import has_cuda_gpu

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        cpu = m.group(1).strip() if m else cpu
        # The vector ISA too: the same "AMD EPYC" name covered an AVX2-only machine and
        # an AVX-512 one, whose GEMMs give verification a different cost curve
        # (docs/benchmarks.md, 2026-12-05 evening).
        fam = re.search(r"^cpu family\s*:\s*(\d+)$", info, re.M)
        mod = re.search(r"^model\s*:\s*(\d+)$", info, re.M)
        flags = set((re.search(r"^flags\s*:\s*(.+)$", info, re.M) or [None, ""])[1].split())
        isa = ("AVX-512" + (" with bf16" if "avx512_bf16" in flags else "")
               if "avx512f" in flags else "AVX2 only" if "avx2" in flags else "no AVX2")
        if fam and mod:
            cpu += f", family {fam.group(1)} model {mod.group(1)}"
        cpu += f", {isa}"
    except OSError:
        pass
    text = f"{os.cpu_count()}-core CPU ({cpu}, {platform.machine()})"
    if has_cuda_gpu():
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        text += f", GPU: {r.stdout.strip().splitlines()[0] if r.stdout.strip() else '?'}"
    else:
        text += ", no GPU"
    return text


def replace_section(doc, section: str, body: str) -> None:
    """Put `body` between `<!-- SECTION: begin -->` and `<!-- SECTION: end -->` in the
    markdown file `doc` (appended, with its markers, where they are missing; the file is
    created with a `# Benchmarks` title where it does not exist). The benchmarks that
    write docs/benchmarks.md share this."""
    doc = pathlib.Path(doc)
    begin, end = f"<!-- {section}: begin -->", f"<!-- {section}: end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text[text.index(begin):]:
        i = text.index(begin)
        j = text.index(end, i) + len(end)
        text = text[:i] + block + text[j:]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def version(*names: str) -> str:
    """The installed version of the first distribution of `names` found ("?" if none)."""
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def git_rev() -> str:
    """The repository's HEAD (short hash), "+ uncommitted changes" where there are."""
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _key(r: dict) -> tuple:  # the setting a row measured
    return (r["workload"], r["sampling"], r["concurrency"])


def x_plain(r: dict, plain: dict | None) -> float | None:
    """Tokens/s over plain's at the same setting; interleaved runs: the median of the
    per-round ratios (each against plain's run of the same round)."""
    if plain is None:
        return None
    rounds = r.get("x_plain_rounds")
    if rounds:
        return statistics.median(rounds)
    return r["tok_per_s"] / plain["tok_per_s"]


def efficiency(r: dict, plain: dict | None) -> tuple[float | None, float | None]:
    """(bound, measured speedup / bound) of a speculative row against plain's row at the
    same setting (bench/e2e.py's module doc)."""
    ms, pms = r.get("step_ms") or {}, (plain or {}).get("step_ms") or {}
    if not ms or not pms or r["method"] == "plain":
        return None, None
    tau = (r["tokens"] / ms["steps"]) / (plain["tokens"] / pms["steps"])
    cost = ms["drafter"] + ms["target_forward"] + ms["sampler"]
    bound = tau * pms["step"] / cost
    return bound, x_plain(r, plain) / bound


def engine_tables(rows: list[dict]) -> str:
    """Markdown of engine rows (`Engine.measure`, `run_method`, `run_interleaved`):
    tokens/s with ratios to plain and greedy identity, the step profile with the
    integration efficiency, peak memory and abort time per method, acceptance per
    position."""
    out = []
    plain_rows = {_key(r): r for r in rows if r["method"] == "plain"}
    out.append("| method | workload | sampling | conc. | tok/s | x plain | mean acc. length "
               "| greedy = plain |")
    out.append("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        pr = plain_rows.get(_key(r))
        ratio = x_plain(r, pr)
        same = ""
        if r["sampling"] == "greedy" and pr and r["method"] != "plain":
            n = sum(a == b for a, b in zip(r["outputs"], pr["outputs"]))
            same = f"{n}/{len(r['outputs'])}"
        ratio_s = "" if ratio is None else f"{ratio:.2f}"
        if r.get("x_plain_rounds") and r["method"] != "plain":
            ratio_s += " (" + " / ".join(f"{x:.2f}" for x in r["x_plain_rounds"]) + ")"
        tau = r["acceptance_length"]
        tau_s = "" if tau is None else f"{tau:.2f}"
        out.append(f"| {r['method']} | {r['workload']} | {r['sampling']} | {r['concurrency']} "
                   f"| {r['tok_per_s']:.1f} | {ratio_s} | {tau_s} | {same} |")
    out.append("")
    src = [r for r in rows if r.get("sources")]
    if src:
        out.append("Where DSpine's verified drafts came from (request-steps with drafts, "
                   "and drafts, from the drafter and from the lookup, and of the lookup's "
                   "those the corpus lookup gave; docs/lookup.md):")
        out.append("")
        out.append("| method | workload | sampling | conc. | drafter request-steps (drafts) "
                   "| lookup request-steps (drafts) | of them from the corpus |")
        out.append("| --- | --- | --- | ---: | ---: | ---: | ---: |")
        for r in src:
            c = r["sources"]
            out.append(f"| {r['method']} | {r['workload']} | {r['sampling']} "
                       f"| {r['concurrency']} | {c.get('drafter_request_steps', 0)} "
                       f"({c.get('drafter_drafts', 0)}) | {c.get('lookup_request_steps', 0)} "
                       f"({c.get('lookup_drafts', 0)}) | {c.get('corpus_request_steps', 0)} "
                       f"({c.get('corpus_drafts', 0)}) |")
        out.append("")
    out.append("Time per engine step, measured in the engine (ms; host = step - target - "
               "sampler - drafter, the model runner's own work; outside = wall time per "
               "step not in the runner: scheduler, output processing, the front end), and "
               "the integration efficiency (module doc of bench/e2e.py; it can exceed 1 "
               "where a method's time outside the runner per token is below plain's, which "
               "the bound does not count):")
    out.append("")
    out.append("| method | workload | sampling | conc. | step | draft fwd | retrieval + tail "
               "| drafter (all) | target fwd | sampler | host | outside | tokens/step "
               "| bound | x plain | efficiency |")
    out.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
               "| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ms = r.get("step_ms") or {}
        if not ms:
            continue
        pr = plain_rows.get(_key(r))
        bound, eff = efficiency(r, pr)
        ratio = x_plain(r, pr)
        f = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
        dspine = r["method"].startswith("dspine")
        draft_fwd = f"{ms['draft_forward']:.1f}" if dspine else ""
        tail = f"{ms['retrieval_tail']:.1f}" if dspine else ""
        out.append(
            f"| {r['method']} | {r['workload']} | {r['sampling']} | {r['concurrency']} "
            f"| {ms['step']:.1f} | {draft_fwd} | {tail} | {ms['drafter']:.1f} "
            f"| {ms['target_forward']:.1f} | {ms['sampler']:.1f} | {ms['host']:.1f} "
            f"| {1e3 * r['seconds'] / ms['steps'] - ms['step']:.1f} "
            f"| {r['tokens'] / ms['steps']:.2f} | {f(bound)} | {f(ratio)} | {f(eff)} |")
    out.append("")
    out.append("Per method (engine process): peak resident memory, and the time from "
               "aborting 8 running requests to the scheduler having freed their KV blocks "
               "(KV usage then):")
    out.append("")
    out.append("| method | peak RSS (MiB) | abort -> KV freed (ms) | KV usage after |")
    out.append("| --- | ---: | ---: | ---: |")
    seen = set()
    for r in rows:
        if r["method"] in seen:
            continue
        seen.add(r["method"])
        a = r.get("abort_ms")
        u = r.get("kv_usage_after_abort")
        rss = r.get("peak_rss_mib")
        out.append(f"| {r['method']} | {'' if rss is None else f'{rss:.0f}'} | "
                   f"{'' if a is None else f'{a:.1f}'} | {'' if u is None else f'{u:.3f}'} |")
    out.append("")
    out.append("Acceptance rate per draft position (first 15; concurrency of the first row "
               "of each method):")
    out.append("")
    out.append("| method | workload | sampling | " + " | ".join(str(i + 1) for i in range(K))
               + " |")
    out.append("| --- | --- | --- |" + " ---: |" * K)
    seen = set()
    for r in rows:
        key = (r["method"], r["workload"], r["sampling"])
        if key in seen or not r["acceptance_per_pos"]:
            continue
        seen.add(key)
        pp = (r["acceptance_per_pos"] + [0.0] * K)[:K]
        out.append(f"| {r['method']} | {r['workload']} | {r['sampling']} | "
                   + " | ".join(f"{x:.2f}" for x in pp) + " |")
    return "\n".join(out)


def engine_plots(rows: list[dict], img_dir: pathlib.Path, suffix: str = "") -> list[str]:
    """Two PNGs: tokens/s by method and concurrency (one panel per workload x sampling),
    acceptance by position per method. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    panels = list(dict.fromkeys((r["workload"], r["sampling"]) for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    width = 0.8 / max(len(methods), 1)
    for ax, (w, sname) in zip(axes[0], panels):
        for j, m in enumerate(methods):
            vals = [next((r["tok_per_s"] for r in rows if r["method"] == m and
                          r["workload"] == w and r["sampling"] == sname and
                          r["concurrency"] == c), 0.0) for c in concs]
            ax.bar([i + j * width for i in range(len(concs))], vals, width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(concs))])
        ax.set_xticklabels([f"c={c}" for c in concs])
        ax.set_title(f"{w}, {sname}")
        ax.set_ylabel("output tokens/s")
    tok_png = _save(fig, axes, img_dir / f"e2e{suffix}_tokens_per_s.png")

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (w, sname) in zip(axes[0], panels):
        for m in methods:
            r = next((r for r in rows if r["method"] == m and r["workload"] == w and
                      r["sampling"] == sname and r["acceptance_per_pos"]), None)
            if r is not None:
                pp = r["acceptance_per_pos"][:K]
                ax.plot(range(1, len(pp) + 1), pp, marker="o", label=m)
        ax.set_title(f"{w}, {sname}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
    acc_png = _save(fig, axes, img_dir / f"e2e{suffix}_acceptance.png")
    return [tok_png, acc_png]


def _save(fig, axes, path: pathlib.Path) -> str:
    import matplotlib.pyplot as plt

    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
