"""Run vLLM's own connector unit tests against ecd's connectors (`make test-vllm-upstream`).

The tests are vLLM's, from the sdist of the vLLM installed in the running interpreter, taken
from the package index at test time (the sha256 pinned below) and cached under
.cache/vllm-upstream/ (git-ignored): nothing of vLLM's is in this repository. The connector
unit tests (tests/v1/kv_connector/unit, tests/v1/ec_connector/unit) that apply to ecd (the
list in cases.py, each with the reason it applies) run with ecd_upstream_plugin.py, which puts
ecd's connectors where the tests look for a storage connector and starts a real ecd daemon.

Exit status: 0 when every applicable test passes, or every failure is a documented gap
(cases.GAPS, docs/vllm.md "vLLM's own connector tests"); 1 otherwise. When the sdist cannot be
had (no network, an unpinned vLLM version), it says why and exits 0 (skipped), unless
ECD_UPSTREAM_REQUIRED=1.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("ECD_UPSTREAM_CACHE", REPO / ".cache" / "vllm-upstream"))
HERE = Path(__file__).resolve().parent

# vLLM's sdists on PyPI (they carry the tests/ tree), by version.
SDIST_SHA256 = {
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
}
# What of the sdist the connector unit tests import (not tests/conftest.py: it needs vLLM's
# whole test environment, none of which these tests use).
MEMBERS = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/kv_connector/", "tests/v1/ec_connector/",
           "tests/v1/core/__init__.py", "tests/v1/core/utils.py", "tests/v1/core/test_scheduler.py",
           "tests/v1/core/test_prefix_caching.py")


class Unavailable(Exception):
    """The tests cannot be had here: skipped, saying why."""


def vllm_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                         text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if out.returncode != 0:
        raise Unavailable(f"vLLM does not import here: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout.strip().splitlines()[-1].split("+")[0]


def sdist_url(version: str) -> str:
    """The sdist's URL from the package index's simple API (PEP 691 JSON), PIP_INDEX_URL's or PyPI's."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(f"{index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    name = f"vllm-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == name:
            return entry["url"]
    raise Unavailable(f"{index} has no {name}")


def fetch(version: str) -> Path:
    """The extracted test tree of vLLM `version`, downloaded and checked once, then cached."""
    want = SDIST_SHA256.get(version)
    if want is None:
        raise Unavailable(f"vLLM {version}: no pinned sdist hash (tests/vllm_upstream/run.py SDIST_SHA256)")
    root = CACHE / f"vllm-{version}"
    if (root / ".complete").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"vllm-{version}.tar.gz"
    if not archive.exists() or hashlib.sha256(archive.read_bytes()).hexdigest() != want:
        try:
            url = sdist_url(version)
            partial = archive.with_suffix(".part")
            with urllib.request.urlopen(url, timeout=300) as response, open(partial, "wb") as out:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
        except OSError as exc:
            raise Unavailable(f"could not download vLLM {version}'s sdist: {exc}") from None
        got = hashlib.sha256(partial.read_bytes()).hexdigest()
        if got != want:
            partial.unlink()
            raise Unavailable(f"vLLM {version}'s sdist has sha256 {got}, pinned {want}: not used")
        partial.rename(archive)
    prefix = f"vllm-{version}/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if m.isfile() and m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(MEMBERS)]
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(root, members=members, filter="data")
    (root / ".complete").write_text(want)
    return root


def run_tests(root: Path, node_ids: list[str], report: Path) -> int:
    """pytest on the files that hold `node_ids`; the plugin keeps only those tests (a test this
    vLLM's tree lacks is then simply absent, not an error)."""
    select = report.with_name("select.txt")
    select.write_text("\n".join(node_ids))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "ECD_UPSTREAM_REPORT": str(report), "ECD_UPSTREAM_SELECT": str(select),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])}
    files = sorted({n.split("::")[0] for n in node_ids if (root / n.split("::")[0]).exists()})
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ecd_upstream_plugin",
               f"--rootdir={root}", "-o", "addopts=", *files]
    return subprocess.run(command, cwd=root, env=env).returncode


def summarize(version: str, results: dict, gaps: dict[str, str]) -> tuple[list[str], list[str]]:
    """(lines to print, applicable tests that failed and are not documented gaps). The list is
    vLLM 0.33's: under 0.33 a test missing from the run is a failure; another version's tree
    may lack some (then they are named, not counted)."""
    lines, unexpected = [], []
    newest = version == cases.NEWEST
    absent = [n for n in cases.applicable(version) if n not in results]
    applicable = [n for n in cases.applicable(version) if n in results or newest]
    for node in applicable:  # a test that never made an ecd connector did not test ecd
        entry = results.get(node)
        if entry and entry["outcome"] == "passed" and not entry["ecd"]:
            entry.update(outcome="failed", message="passed without constructing an ecd connector")
    passed = [n for n in applicable if results.get(n, {}).get("outcome") == "passed"]
    for node in applicable:
        entry = results.get(node, {"outcome": "not run", "message": "absent from the run"})
        if entry["outcome"] == "passed":
            continue
        reason = gaps.get(node)
        lines.append(f"  {entry['outcome'].upper()} {node}\n      {entry['message']}\n      "
                     + (f"gap: {reason}" if reason else "NOT a documented gap"))
        if reason is None:
            unexpected.append(node)
    lines.insert(0, f"vLLM {version}'s connector unit tests against ecd: {len(passed)} of {len(applicable)} "
                    f"applicable pass")
    if not newest and absent:
        lines.append(f"  absent from vLLM {version}'s tests: " + ", ".join(absent))
    return lines, unexpected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="write each applicable test's outcome here (JSON)")
    args = parser.parse_args()
    required = os.environ.get("ECD_UPSTREAM_REQUIRED") == "1"
    try:
        version = vllm_version()
        root = fetch(version)
    except Unavailable as exc:
        print(f"vLLM's connector tests SKIPPED: {exc}")
        return 1 if required else 0
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        rc = run_tests(root, cases.applicable(version), report)
        results = json.loads(report.read_text()) if report.exists() else {}
    lines, unexpected = summarize(version, results, cases.gaps(version))
    print("\n".join(lines))
    if rc not in (0, 1):  # 2: collection errors, 3: internal error, 4: usage, 5: nothing ran
        print(f"pytest exited with {rc}: the harness itself failed")
        return 1
    if args.report:
        Path(args.report).write_text(json.dumps({"version": version, "results": results}, indent=1))
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
