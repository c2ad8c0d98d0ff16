"""The front door and the guide hold together: every relative link in the
README and docs/ resolves to a file (and, with an #anchor, to a heading of
that page), and every page of docs/ is reachable from the README."""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page):
    """GitHub's anchors for a page's headings."""
    out = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def main():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken, reached = [], set()
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code are code
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                continue
            reached.add(dest)
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    unlinked = [p.relative_to(ROOT) for p in pages[1:] if p.resolve() not in reached]
    if broken or unlinked:
        sys.exit("\n".join(broken + [f"docs page reached from no page: {p}" for p in unlinked]))
    print(f"{len(pages)} pages, every relative link resolves, every docs page is linked")


if __name__ == "__main__":
    main()
