"""docs/: the claims index has one anchor per claim, and every link into it (or to a file) resolves."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLAIMS = ROOT / "docs" / "claims.md"
NUM_CLAIMS = 20
ANCHOR = re.compile(r'<a id="claim-(\d+)"></a>')
CLAIM_LINK = re.compile(r"\]\(([^)\s]*claims\.md)#claim-(\d+)\)")
FILE_LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s#]+)(?:#[^)\s]*)?\)")


def notebook_text(path: Path) -> str:
    """Every cell's source and every text output of a notebook (tables are displayed as Markdown)."""
    parts = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            parts.append("".join(output.get("text", "")))
            parts.append("".join(output.get("data", {}).get("text/markdown", "")))
    return "\n".join(parts)


def linking_files() -> list[tuple[Path, str]]:
    files = [(ROOT / "README.md", (ROOT / "README.md").read_text(encoding="utf-8"))]
    files += [(p, notebook_text(p)) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    return files


def anchors() -> list[int]:
    return [int(n) for n in ANCHOR.findall(CLAIMS.read_text(encoding="utf-8"))]


def test_claims_index_has_one_anchor_per_claim():
    found = anchors()
    assert sorted(found) == list(range(1, NUM_CLAIMS + 1)), f"anchors in docs/claims.md: {found}"


@pytest.mark.parametrize("path,text", linking_files(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_claim_links_point_at_existing_anchors(path, text):
    known = set(anchors())
    for target, number in CLAIM_LINK.findall(text):
        assert (path.parent / target).resolve() == CLAIMS.resolve(), f"{path.name}: {target} is not docs/claims.md"
        assert int(number) in known, f"{path.name}: claims.md#claim-{number} has no anchor"


def test_claims_index_links_its_own_anchors():
    text = CLAIMS.read_text(encoding="utf-8")
    known = set(anchors())
    for number in re.findall(r"\]\(#claim-(\d+)\)", text):
        assert int(number) in known, f"#claim-{number} has no anchor"


@pytest.mark.parametrize("doc", ["README.md", "docs/claims.md", "docs/workshop.md"])
def test_relative_links_name_existing_files(doc):
    path = ROOT / doc
    for target in FILE_LINK.findall(path.read_text(encoding="utf-8")):
        assert (path.parent / target).exists(), f"{doc}: link to {target}, which does not exist"
