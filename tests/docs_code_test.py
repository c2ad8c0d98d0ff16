"""Every code block in the README and docs/ runs, or says why it does not.

A block's info string is its language and, optionally, `not-run`:

- `python`: run. The blocks of one page run in order in one namespace that
  starts with `np`, `tessel` and `tnp` (`tessel.numpy`) imported, inside a
  local cluster of 2 workers with 2 devices each (a block that starts its own
  `local_cluster` runs outside it).
- `python not-run`: compiled, not run (a fragment: it names what the page
  around it defines).
- `text`: output or prose, not code.
- any other language (`sh`, `c++`, `cmake`, ...) must say `not-run`: what
  runs here is Python; the shell and C++ the docs show are run by the CI
  script, the demo and the C++ tests.

A block without a language is an error, as is one that fails.
"""

import pathlib
import re
import sys
import traceback

import tessel

ROOT = pathlib.Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
PRELUDE = "import numpy as np\nimport tessel\nimport tessel.numpy as tnp\n"


def blocks(page):
    """(line, language, flags, code) of each fenced block of `page`."""
    text = page.read_text()
    for m in FENCE.finditer(text):
        words = m.group(1).split()
        line = text.count("\n", 0, m.start()) + 1
        yield line, (words[0] if words else ""), words[1:], m.group(2)


def main():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems, runs, marked = [], [], 0
    for page in pages:
        name = page.relative_to(ROOT)
        for line, lang, flags, code in blocks(page):
            where = f"{name}:{line}"
            if not lang:
                problems.append(f"{where}: a block without a language: say `text` for output, else its language")
            elif lang == "text":
                continue
            elif "not-run" in flags:
                marked += 1
                if lang == "python":
                    try:
                        compile(code, where, "exec")
                    except SyntaxError as e:
                        problems.append(f"{where}: does not compile: {e}")
            elif lang == "python":
                runs.append((page, where, code))
            else:
                problems.append(
                    f"{where}: a `{lang}` block not marked `not-run`: only Python blocks run here; "
                    f"mark it `{lang} not-run`, or make it Python"
                )
    if problems:
        sys.exit("\n".join(problems))
    run_all(runs)
    print(f"{len(pages)} pages: {len(runs)} Python blocks ran, {marked} blocks marked not-run")


def run_all(runs):
    cluster = None
    namespaces = {}
    try:
        for page, where, code in runs:
            ns = namespaces.setdefault(page, {})
            if not ns:
                exec(PRELUDE, ns)
            own_cluster = "local_cluster(" in code
            if not own_cluster and cluster is None:
                cluster = tessel.local_cluster(workers=2, devices_per_worker=2)
                cluster.__enter__()
            try:
                if own_cluster and cluster is not None:
                    cluster.__exit__(None, None, None)
                    cluster = None
                exec(compile(code, where, "exec"), ns)
            except Exception:
                sys.exit(f"{where}: the block failed:\n{traceback.format_exc()}")
    finally:
        if cluster is not None:
            cluster.__exit__(None, None, None)


if __name__ == "__main__":
    main()
