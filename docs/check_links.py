"""Every relative link in README.md and the Markdown files under docs/ (docs/records/ too) points at
a file that exists, and every #anchor at a heading of that file (GitHub's slugs).
Run: python docs/check_links.py"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


def main() -> int:
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif not dest.is_relative_to(ROOT):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (outside the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    print("\n".join(bad) or "all links resolve")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
