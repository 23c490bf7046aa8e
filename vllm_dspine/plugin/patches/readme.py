"""README.md of this folder, rendered from the table (so the index cannot drift from
what `apply_patches()` walks): `python -m vllm_dspine.plugin.patches.readme --write`."""

from __future__ import annotations

import sys
from pathlib import Path

from vllm_dspine.plugin.patches.table import PATCHES, WHEN

README = Path(__file__).with_name("README.md")


def render_index() -> str:
    """README.md of this folder: the table's rows as Markdown."""
    out = [
        "# vLLM patches",
        "",
        "Generated from `table.py` by `python -m vllm_dspine.plugin.patches.readme "
        "--write`; do not edit by hand (tests/test_vllm_patches.py checks it is current).",
        "",
        "Every change vllm-dspine makes to vLLM 0.32.0, in the order `apply_patches()` "
        "applies them at plugin registration (never on import). Each row first checks "
        "that the symbols it names are there as listed; `python -m "
        "vllm_dspine.plugin.patches.check_source DIR` checks them in another vLLM's "
        "source (docs/compatibility.md). One change is made outside the table, per engine "
        "and through the interface vLLM gives a proposer: `DSpineProposer.load_model` "
        "(`vllm_dspine/proposer/dspine_proposer.py`) sets its runner's "
        "`rejection_sampler` to DSpine's verifier.",
        "",
        "| id | changes | installed | acts on |",
        "| --- | --- | --- | --- |",
    ]
    for p in PATCHES:
        changed = "<br>".join(f"`{s.path}`" for s in p.changes)
        out.append(f"| [`{p.id}`](#{p.id}) | {changed} | {WHEN[p.when]} | {p.acts_on} |")
    for p in PATCHES:
        out += ["", f"## {p.id}", "",
                f"Applied by `{p.apply.replace(':', '.py:')}`; installed "
                f"{WHEN[p.when]}; acts on {p.acts_on}.", "",
                "- **Changes**: " + "; ".join(s.describe() for s in p.changes)]
        if p.checks:
            out.append("- **Checked**: " + "; ".join(s.describe() for s in p.checks))
        out += [f"- **Why**: {p.why}", f"- **How**: {p.how}",
                f"- **Retire when**: {p.retire}"]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        README.write_text(render_index())
        return 0
    if argv == ["--check"]:
        return 0 if README.exists() and README.read_text() == render_index() else 1
    print("usage: python -m vllm_dspine.plugin.patches.readme --write | --check",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
