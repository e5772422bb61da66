"""Which module an op runs in, for the planner's peak detail (`benchmark plan --peak-detail`): the largest storages
at the peak, each with the op that made it and the module it was made in.

In a forward pass (and a checkpoint's recomputation) that is the innermost module whose forward is running,
kept by process-wide forward hooks (`always_call`, so a recomputation that torch stops early still pops its
modules). A backward op runs outside any forward: it is named by the autograd node that runs it, and each node
carries the module that made it in its `metadata`, stamped when the module's forward returns (walking back from
its outputs to the nodes no inner module stamped first).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_leaves

KEY = "planner_module"


class ModulePlaces:
    def __init__(self, root: torch.nn.Module | None = None):
        self.names: dict[int, str] = {}
        self.stack: list[tuple[str, set[int]]] = []   # (module name, its inputs' autograd nodes)
        if root is not None:
            self.name_modules(root)

    def name_modules(self, root: torch.nn.Module, prefix: str = "") -> None:
        for name, module in root.named_modules():
            self.names.setdefault(id(module), f"{prefix}{name}" if name else (prefix.rstrip(".") or "model"))

    def where(self) -> str:
        """The module the current op runs in: 'blocks.3.ffn.net.2', or for a backward op the module whose op's
        gradient it computes, as 'blocks.3.ffn.net.2 (backward: MmBackward0)'."""
        if self.stack:
            recompute = torch._C._current_graph_task_id() != -1
            return self.stack[-1][0] + (" (recomputation)" if recompute else "")
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        return f"{node.metadata.get(KEY, '?')} (backward: {node.name()})"

    @contextlib.contextmanager
    def watching(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module, args):
            inputs = {id(t.grad_fn) for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.grad_fn}
            self.stack.append((self.names.get(id(module), type(module).__name__), inputs))

        def post(module, _args, output):
            if not self.stack:
                return
            name, inputs = self.stack.pop()
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                    _stamp(tensor.grad_fn, name, inputs)

        handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self.stack.clear()


def _stamp(node, name: str, inputs: set[int]) -> None:
    """Names the nodes between a module's output and its inputs (the nodes its forward made)."""
    pending = [node]
    while pending:
        node = pending.pop()
        if node is None or id(node) in inputs or KEY in node.metadata:
            continue
        node.metadata[KEY] = name
        pending.extend(next_node for next_node, _ in node.next_functions)
