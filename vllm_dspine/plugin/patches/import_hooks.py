"""Import hooks (no symbol swapped): row `qwen3_5-text-without-torchvision` of
table.py. The table checks in the source, without importing it, that vLLM's `qwen3_vl`
imports `smart_resize` from the torchvision module and that the PIL sibling defines it."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from vllm_dspine.plugin.patches.guard import is_applied, mark_applied
from vllm_dspine.plugin.patches.table import QWEN2VL_PIL_MODULE, QWEN2VL_TV_MODULE


class _Qwen2VLSmartResizeOnly(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `QWEN2VL_TV_MODULE` as a module holding only `smart_resize`, from its PIL
    sibling. Anything else asked of it (the torchvision image processor) is missing, so
    image inputs still fail loudly without torchvision."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != QWEN2VL_TV_MODULE:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        module.smart_resize = importlib.import_module(QWEN2VL_PIL_MODULE).smart_resize


def patch_qwen3_5_text_without_torchvision() -> None:
    if any(is_applied(f, "qwen3_5-text-without-torchvision") for f in sys.meta_path):
        return
    sys.meta_path.insert(0, mark_applied(_Qwen2VLSmartResizeOnly(),
                                         "qwen3_5-text-without-torchvision"))
