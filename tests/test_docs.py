"""The docs stay true to the code: docs/api.md is what docs/gen_api.py makes of the docstrings,
and every relative link in README.md and docs/ points at a file that exists."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_generated_from_the_current_docstrings():
    gen_api = _load_gen_api()
    current = (ROOT / "docs" / "api.md").read_text()
    assert current == gen_api.render(), "docs/api.md is out of date: run `python docs/gen_api.py`"


def test_api_reference_covers_every_exported_name():
    import roundpipe

    text = (ROOT / "docs" / "api.md").read_text()
    for name in roundpipe.__all__:
        if name.startswith("__"):
            continue
        assert f"roundpipe.{name}" in text, name


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_ANCHORED_LINK = re.compile(r"\]\(([^)#\s]*\.md)#([^)\s]+)\)")


def _heading_anchors(markdown):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to
    hyphens (code fences skipped)."""
    anchors, in_code = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_point_at_existing_files():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 1
    broken = []
    for page in pages:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _project_text_files(with_tests):
    """The text a user or a contributor reads: the README, the docs, the package, the examples,
    the benchmarks (and, with ``with_tests``, the tests), as ``(path, text)`` pairs."""
    paths = [ROOT / "README.md", ROOT / "pyproject.toml"]
    folders = ["docs", "roundpipe", "examples", "benchmarks"] + (["tests"] if with_tests else [])
    for folder in folders:
        paths += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".md", ".py"))
    return [(p, p.read_text()) for p in paths]


_MD_NAME = re.compile(r"[\w./-]*\w\.md\b")


def test_every_markdown_file_the_project_names_is_in_the_repository():
    """A name such as ``docs/scaler.md`` in a docstring, a comment or a page must be a file of
    this repository (next to the file that names it, at the root, or in docs/): a reader sent to
    a file that is not there finds nothing."""
    missing = []
    for path, text in _project_text_files(with_tests=True):
        for name in sorted(set(_MD_NAME.findall(text))):
            bases = (path.parent, ROOT, ROOT / "docs")
            if not any((base / name).exists() for base in bases):
                missing.append(f"{path.relative_to(ROOT)} names {name}")
    assert not missing, "names of files that are not in the repository:\n" + "\n".join(missing)


def test_no_text_sends_a_user_to_the_package_index_for_roundpipe():
    """A different project has the name roundpipe on the package index: installs are from the
    checkout (``pip install -e ".[extra]"``), in the README, the docs, messages and docstrings."""
    index_install = re.compile(r"pip3? install\s+(?:-U\s+|--upgrade\s+)?[\"']?roundpipe\b")
    offenders = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path, text in _project_text_files(with_tests=False)
        for m in index_install.finditer(text)
    ]
    assert not offenders, "\n".join(offenders)


def test_links_to_a_section_name_a_heading_of_that_page():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in _ANCHORED_LINK.findall(page.read_text()):
            path = page.parent / target
            if path.exists() and anchor not in _heading_anchors(path.read_text()):
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, "links to sections that do not exist:\n" + "\n".join(broken)


def test_benchmarks_page_is_assembled_from_the_current_results():
    spec = importlib.util.spec_from_file_location(
        "gen_benchmarks", ROOT / "docs" / "gen_benchmarks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page == module.render(), (
        "docs/benchmarks.md is out of date: run `python docs/gen_benchmarks.py`"
    )
    for section in ("## GradScaler", "## roundpipe.optim", "## Runtime"):
        assert section in page


def _run_readme_loop(monkeypatch, devices):
    """The loop under "## The loop" in README.md, with a concrete model and loader, on the pool
    ``devices`` names through ROUNDPIPE_DEVICES (as a user would); the loss it logs is the real
    (unscaled) one. Returns the trained parameters."""
    import torch
    import torch.nn.functional as F

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S)[1]
    placeholder = "seq_model = torch.nn.Sequential(...)"
    assert placeholder in code
    code = code.replace(placeholder, "seq_model = make_model()")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    loader = [
        (torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(6)
    ]
    holder = {}

    def make_model():
        holder["model"] = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        )
        holder["before"] = [p.detach().clone() for p in holder["model"].parameters()]
        return holder["model"]

    real_losses = []  # every cross entropy the loop's loss_fn computes, unscaled
    cross_entropy = F.cross_entropy

    def recording_cross_entropy(*args, **kwargs):
        loss = cross_entropy(*args, **kwargs)
        real_losses.append(loss.item())
        return loss

    monkeypatch.setattr(F, "cross_entropy", recording_cross_entropy)
    monkeypatch.setenv("ROUNDPIPE_DEVICES", devices)
    namespace = {"make_model": make_model, "loader": loader}
    exec(compile(code, "README.md", "exec"), namespace)
    # The last iteration: 4 microbatches, each loss divided by 4 in loss_fn.
    assert len(real_losses) == 4 * len(loader)
    assert namespace["real_loss"] == pytest.approx(sum(real_losses[-4:]) / 4, rel=1e-6)
    after = list(holder["model"].parameters())
    assert all(p.dtype == torch.float16 for p in after)
    assert all(not torch.equal(a, b.half()) for a, b in zip(after, holder["before"]))  # trained
    assert namespace["scaler"].snapshot().steps == len(loader)
    return [p.detach().clone() for p in after]


def test_the_readme_loop_runs_as_written_on_cpu_and_on_the_emulated_accelerator(monkeypatch):
    # The same loop, unchanged, on one CPU worker and on one and two emulated devices (which
    # reject host tensors and run backward off the calling thread, as CUDA does): the trained
    # parameters are the same bit for bit.
    results = {
        devices: _run_readme_loop(monkeypatch, devices) for devices in ("cpu", "emu", "emu:2")
    }
    for devices in ("emu", "emu:2"):
        for a, b in zip(results["cpu"], results[devices]):
            assert torch.equal(a, b), devices


def test_every_cited_note_is_written_once():
    # A long invariant is written once under a line "# [Note: name]" ("// [Note: name]" in the
    # C++ sources, "[Note: name]" in a docstring) and cited elsewhere by its name; a citation
    # must not outlive the note (code moves between files).
    note = re.compile(r"\[Note: ([^\]]+)\]")
    header = re.compile(r"^\s*(?:# |// )?\[Note: ([^\]]+)\]\s*$", re.MULTILINE)
    files = [
        *sorted((ROOT / "roundpipe").rglob("*.py")),
        *sorted((ROOT / "roundpipe").rglob("*.cpp")),
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "README.md",
        *sorted((ROOT / "tests").glob("*.py")),
    ]
    written, cited = {}, set()
    for path in files:
        text = path.read_text()
        for name in header.findall(text):
            written.setdefault(name, []).append(path.name)
        if path.name != "test_docs.py":
            cited.update(" ".join(name.split()) for name in note.findall(text))
    assert {n: w for n, w in written.items() if len(w) > 1} == {}
    assert cited - set(written) == set()
    assert len(written) > 10
