"""A chunk's backward in two halves: B, the input gradient, and later W, the weights'.

``backward_input(out, grad, x, params)`` computes the gradient of the chunk's input
``x`` only. The autograd graph is kept, and so are the gradients that reach the
*frontier*: the nodes on a path from the output to ``x`` that also feed a parameter (a
matmul's backward gives both dx and dW from one dy; B asks it for dx, the hook keeps dy).
``backward_weight(kept)`` then runs the graph from the frontier to the parameters with
those gradients, and hands each parameter's gradient to its accumulator: ``.grad`` is
written, and its post-accumulate hooks (data parallel's buckets, ZeRO's reduce-scatter)
fire, at W and never at B.

B then W computes the very operations one backward does, on the same tensors: the
gradients are equal bit for bit. A chunk with no input gradient (the first stage reads
token ids) has nothing for B to do: W runs its whole backward.

The frontier is grouped as ``torch.distributed.pipelining``'s ``stage_backward_input`` /
``stage_backward_weight`` group it: parameters whose paths meet at a frontier node go
together, and in each group's pass a frontier node's gradient is the kept one (a hook
replaces what flows into it from another frontier node, which B counted already).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class _Group:
    params: list[torch.Tensor]
    nodes: list[Node]
    grads: list[tuple | None] = field(default_factory=list)
    batch: object = None
    """Groups with the same ``batch`` run in one W pass (``_batch_keys``)."""


@dataclass
class KeptWork:
    """What W needs: the frontier's gradients by group (``whole``: no B was possible,
    W runs the entire backward from ``out`` with ``grad``)."""

    groups: list[_Group]
    whole: tuple[torch.Tensor, torch.Tensor] | None = None


def _node(t: torch.Tensor) -> Node | None:
    """The graph node a gradient of ``t`` goes to: its grad_fn, or a leaf's accumulator
    (made on demand, through a view, as autograd makes it)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0] if t.requires_grad else None


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Each node's consumers in the graph below ``root`` (the reversed edges)."""
    users: dict[Node, list[Node]] = defaultdict(list)
    seen, todo = {root}, deque([root])
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            users[child].append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return users


def _above(start: Node, users: dict[Node, list[Node]], stop: set[Node]) -> tuple[set, set]:
    """Nodes reachable upward from ``start`` without entering ``stop``, and the ``stop``
    nodes met on the way."""
    inside, met, todo = {start}, set(), deque([start])
    while todo:
        for user in users.get(todo.popleft(), []):
            if user in stop:
                met.add(user)
            elif user not in inside:
                inside.add(user)
                todo.append(user)
    return inside, met


def _groups(root: Node, x_node: Node, params: Sequence[torch.Tensor]) -> list[_Group]:
    users = _consumers(root)
    on_x_path, _ = _above(x_node, users, set())
    by_node: dict[Node, _Group] = {}
    for p in params:
        acc = _node(p)
        if acc is None or acc not in users:
            continue  # not used by this chunk's output
        _, frontier = _above(acc, users, on_x_path)
        if not frontier:
            raise RuntimeError("a parameter's gradient does not pass through the input's "
                               "path; the backward cannot be split")
        merged = {id(g): g for n in frontier if (g := by_node.get(n))}
        group = _Group([p], sorted(frontier, key=id))
        for other in merged.values():
            group.params += other.params
            group.nodes += [n for n in other.nodes if n not in group.nodes]
        for n in group.nodes:
            by_node[n] = group
    groups = list({id(g): g for g in by_node.values()}.values())
    _batch_keys(root, users, on_x_path, groups)
    return groups


def _batch_keys(root: Node, users: dict[Node, list[Node]], on_x_path: set,
                groups: list[_Group]) -> None:
    """Key the groups whose W can run in one engine pass: those whose frontier nodes have
    as many frontier nodes above them (siblings such as q, k and v, which read the same
    input). None of them then lies below another, so the pass computes no input-path
    gradient from one frontier node towards another's parameters (it would be correct,
    the kept gradients replacing it, but wasted). A group of several nodes runs alone."""
    frontier = {n for g in groups for n in g.nodes}
    waiting = {n: len(users.get(n, ())) for n in on_x_path}
    depth, ready = {root: 0}, [root]
    while ready:  # from the output down the input's path, each node after its consumers
        node = ready.pop()
        below = depth[node] + (node in frontier)
        for child, _ in node.next_functions:
            if child in waiting:
                depth[child] = max(depth.get(child, 0), below)
                waiting[child] -= 1
                if waiting[child] == 0:
                    ready.append(child)
    for g in groups:
        g.batch = depth.get(g.nodes[0]) if len(g.nodes) == 1 else id(g)


def backward_input(out: torch.Tensor, grad: torch.Tensor, x: torch.Tensor | None,
                   params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, KeptWork]:
    """The gradient of ``x`` (None when ``x`` needs none), and what W needs later."""
    if x is None or not x.requires_grad:
        return None, KeptWork([], whole=(out, grad))
    groups = _groups(out.grad_fn, _node(x), [p for p in params if p.requires_grad])
    handles = []
    for group in groups:
        group.grads = [None] * len(group.nodes)
        for i, node in enumerate(group.nodes):
            def keep(grad_outputs, group=group, i=i):
                group.grads[i] = grad_outputs
            handles.append(node.register_prehook(keep))
    try:
        # The engine itself: the Python wrapper checks ``grad`` against ``out``, whose data
        # may be released after its send (executor: only its graph is kept). Accumulated
        # into x, the pass's one input: a node may then ask which of its inputs this pass
        # runs (tensor parallelism's fused entry leaves its weight GEMMs to W).
        torch.autograd.Variable._execution_engine.run_backward(
            (out,), (grad,), True, False, (x,), allow_unreachable=True, accumulate_grad=True)
        dx = x.grad
    finally:
        for h in handles:
            h.remove()
    return dx, KeptWork(groups)


def _weight_pass(groups: list[_Group]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One engine pass from the groups' frontier nodes, with their kept gradients, to
    their parameters: (parameter, gradient) pairs."""
    nodes = [n for g in groups for n in g.nodes]
    kept = [k for g in groups for k in g.grads]
    edges, given = [], []
    for node, kept_grads in zip(nodes, kept):
        for i, g in enumerate(kept_grads or ()):
            if g is not None:
                edges.append(GradientEdge(node, i))
                given.append(g)
    if not edges:
        return []
    # Where one frontier node lies below another, what flows into it is replaced by
    # what B kept (B counted that path already).
    handles = ([node.register_prehook(lambda _, g=g: g) for node, g in zip(nodes, kept)]
               if len(nodes) > 1 else [])
    params = [p for g in groups for p in g.params]
    try:
        got = torch.autograd.grad(edges, [GradientEdge(_node(p), 0) for p in params], given,
                                  retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return [(p, g) for p, g in zip(params, got) if g is not None]


def backward_weight(kept: KeptWork) -> None:
    """Compute the kept weight gradients and accumulate them into ``.grad`` (hooks fire)."""
    if kept.whole is not None:
        out, grad = kept.whole
        torch.autograd.Variable._execution_engine.run_backward(
            (out,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)
        return
    batches: dict[object, list[_Group]] = {}
    for group in kept.groups:
        batches.setdefault(group.batch, []).append(group)
    params, grads = [], []
    for batch in batches.values():
        for p, g in _weight_pass(batch):
            params.append(p)
            grads.append(g)
    if params:  # through each parameter's accumulator, as a backward ends
        torch.autograd.backward(params, grads)
