"""Make PyPI's torchvision 0.28 importable beside the CPU torch, without its compiled ops.

PyPI carries only CUDA builds of torchvision: its ops library (`_C.so`) links libtorch_cuda and
libc10_cuda, which the CPU torch does not have, so it does not load. torchvision copes with that
for every op (`register_meta` checks `torchvision.extension._has_ops()`) except one: the fake
(meta) kernel of `torchvision::nms` is registered unconditionally at import, and registering a
fake kernel for an operator that was never defined raises
`RuntimeError: operator torchvision::nms does not exist`, so `import torchvision` fails.

vLLM's multimodal processors (through transformers' image processors) need only torchvision's
pure-Python parts (`torchvision.transforms.v2.functional`, which run on torch's own ops), never
its compiled ops. This script puts the same `_has_ops()` guard on that one registration (and on
`qnms`, which 0.29 adds the same way), in the installed `torchvision/_meta_registrations.py` of
the given interpreter's environment; then checks that `import torchvision` and the transforms
work. Idempotent; refuses (exit 1) when the file does not look as expected.

    .venv-engine/bin/python requirements/torchvision_no_ops.py   # make test-engine runs it
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

MARK = "# ecd: guarded, ops library not loadable beside the CPU torch"


def patch() -> str:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return "torchvision is not installed: nothing to do"
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py"
    text = path.read_text()
    if MARK in text:
        return f"{path}: already guarded"
    pattern = re.compile(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$', re.M)
    found = pattern.findall(text)
    if "nms" not in found:
        sys.exit(f"{path}: no unguarded register_fake(\"torchvision::nms\") found: not patching")
    text = pattern.sub(lambda m: (f'@(torch.library.register_fake("torchvision::{m.group(1)}") '
                                  f"if torchvision.extension._has_ops() else (lambda fn: fn))  {MARK}"),
                       text)
    path.write_text(text)
    return f"{path}: guarded {', '.join(found)}"


CHECK = """
import torch, torchvision
from torchvision.transforms.v2 import functional as F
img = torch.arange(3 * 8 * 8, dtype=torch.uint8).reshape(3, 8, 8)
out = F.resize(img, [4, 4], antialias=True)
assert out.shape == (3, 4, 4), out.shape
print("torchvision", torchvision.__version__, "imports; compiled ops loaded:",
      torchvision.extension._has_ops())
"""

if __name__ == "__main__":
    print(patch())
    sys.exit(subprocess.call([sys.executable, "-W", "ignore", "-c", CHECK]))
