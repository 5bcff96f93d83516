"""Two instruments the decode checks run under (no copies of engine code: they watch it run).

- ``PlacementTrap``: the meta-device trap. Inside it the default device is ``meta``, so a tensor made
  without ``device=`` (``torch.rand(shape)``, ``torch.tensor(ids)``) lands on meta instead of silently on
  the CPU, and every tensor a torch function returns is checked to live on the models' device: the first
  one that does not fails the check, naming the function. The same trap runs on the CPU and on CUDA, so a
  placement bug that only a GPU would show (a CPU tensor in a CUDA loop) fails here too.
- ``SyncCounter``: the host syncs of a decode, counted where Python asks the device for a value
  (``.item()``, ``.tolist()``, ``int()``/``float()``/``bool()`` of a tensor, ``.cpu()``, ``.numpy()``). On CUDA
  each one waits for the queued kernels; the check bounds them per decode round. On CUDA it also reads
  ``torch.cuda.set_sync_debug_mode`` warnings, which catch the syncs inside kernels' host code as well.
"""

from __future__ import annotations

import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class PlacementError(AssertionError):
    """A tensor of the decode loop is not on the models' device."""


class PlacementTrap(TorchFunctionMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)
        self.checked = 0

    def __enter__(self):
        self._default = torch.device("meta")
        self._default.__enter__()  # the default-device mode, below this one
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._default.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.checked += 1
                if leaf.device.type != self.device.type or (
                    self.device.index is not None and leaf.device.index not in (None, self.device.index)
                ):
                    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
                    raise PlacementError(
                        f"{name} made a tensor on {leaf.device}, not on {self.device} "
                        f"(a tensor created without device=?)"
                    )
        return out


SYNC_METHODS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}


class SyncCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.by_method: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            self.count += 1
            self.by_method[name] = self.by_method.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class CudaSyncWarnings:
    """``torch.cuda.set_sync_debug_mode("warn")`` while inside: the number of synchronizing CUDA calls (0 on the
    CPU)."""

    def __init__(self, device: torch.device):
        self.device, self.count = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            self.count = sum("synchroniz" in str(r.message) for r in self._records)
            self._catch.__exit__(*exc)
        return False
