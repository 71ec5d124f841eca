"""One executor for every pipeline schedule.

``run_schedule`` walks one rank's action table (``schedules.schedule``) and does what each
action says:

* ``F``: run the chunk of that virtual stage on the microbatch's input (token ids on the
  first stage, the received activation elsewhere) and keep the output for the backward.
  The last stage returns the summed token loss.
* ``B``: backpropagate the kept output with the received gradient (on the last stage:
  the loss times ``loss_scale``); the input's gradient is what goes back. Everything kept
  for this microbatch and stage is dropped. When the table also holds the ``W`` of this
  microbatch and stage (zero-bubble schedules), B computes the input's gradient only and
  keeps the graph (``split.backward_input``); ``W`` computes the weights' gradients
  (``split.backward_weight``), and only W writes ``.grad``, so data parallel's buckets
  and ZeRO's reduce-scatters start at a W.
* A run of consecutive transfers is one batch of non-blocking point-to-point operations
  (``collectives.send_recv``). Nothing waits at the batch: a computation waits only for
  the batch carrying its input, and sends are waited for at the end of the step, so the
  backend completes transfers while the rank computes (batches complete in posting order,
  as NCCL groups do; the tables are checked deadlock-free under that rule).
* On gloo each receive is posted ``receives_ahead`` computations before the table places
  it, alone in its batch (``posting.posting_order``). A receive posted after its data
  arrived waits for gloo's thread to be scheduled: on a busy machine a scheduler slice,
  many times a receive posted in time (measured: docs/pipeline.md), and in GPipe the
  downstream rank, slower by the head, posts every receive late. Early receives cannot
  deadlock on gloo, where each operation completes on its own and a computation waits for
  its own input only; NCCL queues a receive on the stream its sends use, where an early
  one could hold back a send the peer waits for, so there receives stay in place.
* A sent output's data is dropped once its send completes (only its graph is kept for the
  backward). gloo cannot say whether a send completed without waiting for it, so a
  computation also waits for the sends its table placed before its input's receive: the
  waits the in-place table implied, which it is checked deadlock-free with. Without them
  every output sent stayed alive to the end of the step.

Loss scaling: the caller passes ``loss_scale = dp x cp / tokens_in_global_batch``; every
microbatch's summed loss is multiplied by it before backward, so after the data-parallel
average the gradients equal those of the mean loss over the global batch.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ...comm import collectives as C
from .partition import PipelineChunk
from .posting import posting_order, sends_before
from .posting import receives_ahead as default_ahead
from .schedules import Action, ScheduleError
from .split import KeptWork, backward_input, backward_weight
from .timeline import Recorder, Timeline

# (tokens, targets) each (micro_batch, seq), optionally with the tokens' positions in the
# full sequence (context parallelism gives each rank its own; None: 0..seq-1).
Microbatch = tuple[torch.Tensor, ...]


class PipelineStepError(RuntimeError):
    """An action of a rank's table raised; the message shows the table, the action marked,
    and the original error is the cause."""


class _Batch:
    """Posted transfers, waited for once, by whoever needs them first. ``sent`` are the
    outputs it sends: once the send is done only their autograd graph is still needed."""

    def __init__(self, works: list, tensors: list[torch.Tensor], sent: list[torch.Tensor]):
        self.works, self.tensors, self.sent, self.done = works, tensors, sent, False

    def wait(self) -> None:
        if not self.done:
            C.wait_all(self.works)
            # The works hold their tensors too: let both go.
            self.done, self.works, self.tensors = True, [], []
            for out in self.sent:  # Megatron's deallocate_output_tensor: keep the graph only
                out.data = torch.empty(0, dtype=out.dtype, device=out.device)
            self.sent = []

    def poll(self) -> bool:
        """Finish the batch if its transfers completed already (never blocks)."""
        if not self.done and all(w.is_completed() for w in self.works):
            self.wait()
        return self.done


class _Executor:
    """The state of one step: tensors kept for backward, transfers in flight."""

    def __init__(self, chunks: Sequence[nn.Module], microbatches: Sequence[Microbatch],
                 group: ProcessGroup | None, loss_scale: float, device: torch.device,
                 act_shape: tuple[int, ...], act_dtype: torch.dtype,
                 positions: torch.Tensor | None, recorder: Recorder | None,
                 autocast: Callable[[], ContextManager] | None, training: bool,
                 stages: list[int]):
        self.chunks, self.microbatches, self.group = chunks, microbatches, group
        # chunks[i] is this rank's i-th virtual stage, ascending (a loop or a V).
        self.chunk_of = {s: i for i, s in enumerate(stages)}
        self.kept: dict[tuple[int, int], KeptWork] = {}  # B's work W still has to do
        self.training = training  # False: a forward-only table, nothing kept for backward
        self.p = C.size(group) if group is not None else 1
        self.rank = C.rank(group) if group is not None else 0
        self.last = self.p * len(chunks) - 1
        self.loss_scale, self.device = loss_scale, device
        self.act_shape, self.act_dtype, self.positions = act_shape, act_dtype, positions
        self.recorder, self.autocast = recorder, autocast or contextlib.nullcontext
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # (mb, stage) -> fed to chunk
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # kept for backward
        self.grads: dict[tuple[int, int], torch.Tensor] = {}  # gradient of an output
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}  # to send back
        self.arriving: dict[tuple[str, int, int], tuple[_Batch, int]] = {}  # receives not
        # yet waited for, each with the number of send batches to finish with it
        self.sends: list[_Batch] = []  # every send batch of the step, in posting order
        self.settled = 0  # sends[:settled] are done
        self.sends_before: dict[Action, int] = {}  # set by ``_run``: ``posting.sends_before``
        self.loss = torch.zeros((), device=device)

    # ---- timing --------------------------------------------------------------------------
    def _timed(self, kind: str, mb: int, stage: int, fn: Callable[..., None], *args) -> None:
        if self.recorder is None:
            fn(*args)
            return
        start = self.recorder.now()
        fn(*args)
        self.recorder.add(kind, mb, stage, start, self.recorder.now())

    def _await(self, key: tuple[str, int, int]) -> None:
        """Wait for the batch bringing ``key`` (("x"|"g", mb, stage)), if still in flight,
        and for the send batches the table placed before it (usually done already)."""
        batch, sends = self.arriving.pop(key, (None, 0))
        pending = [b for b in [batch, *self.sends[self.settled:sends]] if b and not b.done]
        if pending:
            self._timed("WAIT", -1, -1, _wait_each, pending)
        self.settled = max(self.settled, sends)

    # ---- transfers -----------------------------------------------------------------------
    def post(self, actions: list[Action]) -> None:
        """Post a batch of transfers (recorded as POST: the cost of starting them)."""
        self._timed("POST", -1, -1, self._post, actions)

    def _post(self, actions: list[Action]) -> None:
        if self.group is None:
            raise ScheduleError("the schedule has transfers but no pipeline group was given")
        ops, received, sent = [], [], []
        for a in actions:
            key = (a.microbatch, a.stage)
            if a.kind == "SEND_F":
                out = self.outputs[key] if self.training else self.outputs.pop(key)
                ops.append(C.P2P("send", out.detach().contiguous(), a.peer))
                if self.training and out.is_contiguous():  # else the send holds a copy
                    sent.append(out)
            elif a.kind == "SEND_B":
                ops.append(C.P2P("send", self.input_grads.pop(key).contiguous(), a.peer))
            else:
                buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                ops.append(C.P2P("recv", buf, a.peer))
                received.append((a, buf))
        # Receives first: on gloo a posted receive lets the peer's payload flow at once.
        # A stable sort keeps each channel's order, which is what matching relies on.
        ops.sort(key=lambda op: op.kind != "recv")
        batch = _Batch(C.send_recv(ops, self.group), [op.tensor for op in ops], sent)
        if any(a.kind.startswith("SEND") for a in actions):
            self.sends.append(batch)
        for a, buf in received:
            if a.kind == "RECV_F":
                self.inputs[(a.microbatch, a.stage)] = buf
                self.arriving[("x", a.microbatch, a.stage)] = (batch, self.sends_before[a])
            else:
                self.grads[(a.microbatch, a.stage)] = buf
                self.arriving[("g", a.microbatch, a.stage)] = (batch, self.sends_before[a])

    def poll_sends(self) -> None:
        """Release the outputs of sends the backend reports completed (called between
        computations; NCCL reports it, gloo's sends complete only when waited for)."""
        for batch in self.sends[self.settled:]:
            batch.poll()
        while self.settled < len(self.sends) and self.sends[self.settled].done:
            self.settled += 1

    def finish(self) -> None:
        """Wait for every send: their buffers may be reused once the step returns."""
        for batch in self.sends[self.settled:]:
            if not batch.done:
                self._timed("WAIT", -1, -1, batch.wait)
        self.sends, self.settled = [], 0

    # ---- compute -------------------------------------------------------------------------
    def forward(self, a: Action) -> None:
        mb, s = a.microbatch, a.stage
        tokens, targets, *rest = self.microbatches[mb]
        positions = rest[0] if rest and rest[0] is not None else self.positions
        if s == 0:
            x = tokens
        else:
            self._await(("x", mb, s))
            x = self.inputs[(mb, s)].requires_grad_() if self.training else self.inputs.pop((mb, s))
        chunk = self.chunks[self.chunk_of[s]]

        def run() -> None:
            with self.autocast():
                out = chunk(x, targets if s == self.last else None, positions)
            if s == self.last:
                self.loss += out.detach().float()
            if self.training or (s != self.last and s + 1 not in self.chunk_of):
                self.outputs[(mb, s)] = out  # kept for backward, or until sent
            if s != self.last and s + 1 in self.chunk_of:  # next chunk here
                self.inputs[(mb, s + 1)] = out.detach()

        self._timed("F", mb, s, run)

    def backward(self, a: Action, context: ContextManager, split: bool) -> None:
        mb, s = a.microbatch, a.stage
        if s != self.last:
            self._await(("g", mb, s))

        def run() -> None:
            out = self.outputs.pop((mb, s))
            if s == self.last:
                grad = torch.full_like(out, self.loss_scale)
            else:
                grad = self.grads.pop((mb, s))
            x = self.inputs.pop((mb, s)) if s > 0 else None
            if split:  # the input's gradient now, the weights' at W
                params = self.chunks[self.chunk_of[s]].parameters()
                input_grad, self.kept[(mb, s)] = backward_input(out, grad, x, list(params))
            else:
                with context:
                    _backward(out, grad)
                input_grad = x.grad if x is not None else None
            if s > 0:
                if s - 1 in self.chunk_of:
                    self.grads[(mb, s - 1)] = input_grad
                else:
                    self.input_grads[(mb, s)] = input_grad

        self._timed("B", mb, s, run)

    def weight(self, a: Action, context: ContextManager) -> None:
        kept = self.kept.pop((a.microbatch, a.stage))

        def run() -> None:
            with context:
                backward_weight(kept)

        self._timed("W", a.microbatch, a.stage, run)


def _wait_each(pending: list[_Batch]) -> None:
    for batch in pending:
        batch.wait()


def _backward(out: torch.Tensor, grad: torch.Tensor) -> None:
    """``torch.autograd.backward(out, grad)`` for an output whose data may have been
    released after its send (``_Batch.wait``): the engine checks ``grad`` against the shape
    recorded in the graph, the Python wrapper would check it against the emptied tensor."""
    torch.autograd.Variable._execution_engine.run_backward(
        (out,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def run_schedule(actions: list[Action], chunks: Sequence[nn.Module],
                 microbatches: Sequence[Microbatch], pp_group: ProcessGroup | None,
                 loss_scale: float, device: torch.device, act_shape: tuple[int, ...],
                 act_dtype: torch.dtype = torch.float32,
                 no_sync: Callable[[], ContextManager] | None = None,
                 recorder: Recorder | None = None, positions: torch.Tensor | None = None,
                 autocast: Callable[[], ContextManager] | None = None,
                 receives_ahead: int | None = None) -> torch.Tensor:
    """Run this rank's ``actions`` for one step; return the summed, unscaled loss of all
    microbatches on the rank holding the last stage (zero elsewhere). A table without
    backwards (``schedules.forward_schedule``) runs under ``torch.no_grad`` (evaluation).

    ``chunks`` are the virtual stages the table runs, ascending (``partition.split_model``:
    chunk c is stage ``c * pp + rank``, or on a V (ZBV, DualPipeV) stages rank and
    2pp - 1 - rank);
    ``microbatches[i]`` is microbatch i's (tokens, targets[, positions]): the first stage
    reads tokens, the last reads targets. ``positions`` (default: 0..L-1 for a stream of
    length L) are the places of the tokens attention sees, for the rotary tables: pass
    them when they differ, e.g. arange(seq) under Megatron-SP (the stream is cut along the
    sequence, attention sees all of it) or the rank's shard under context parallelism.
    ``act_shape`` is the shape of the activations received from other stages:
    (micro_batch, seq, d_model), ``seq`` as this rank's stream holds it.
    ``no_sync`` (e.g. ``DataParallel.no_sync``) covers every backward except each chunk's
    last (its last W when split), so the data-parallel reduction starts only with the
    final weight gradients of each chunk and overlaps the rest. ``autocast`` wraps each forward (e.g. bf16 autocast).
    ``pp_group`` may be None for a pipeline of one rank. ``receives_ahead``: how many
    computations early a receive may be posted (None: ``posting.receives_ahead`` of the
    group's backend, 2 on gloo and 0 elsewhere; see the module docstring).
    """
    training = any(a.kind == "B" for a in actions)
    stages = sorted({a.stage for a in actions if a.kind == "F"})
    run = _Executor(chunks, microbatches, pp_group, loss_scale, device, act_shape, act_dtype,
                    positions, recorder, autocast, training, stages)
    _check(actions, run)
    backend = dist.get_backend(pp_group) if pp_group is not None else None
    if receives_ahead is None:
        receives_ahead = default_ahead(backend) if backend else 0
    elif receives_ahead < 0 or (receives_ahead > 0 and backend not in (None, "gloo")):
        raise ValueError(f"receives_ahead={receives_ahead}: receives can be posted early only "
                         f"on gloo (0 or more there); use 0 (or None) on {backend}")
    with contextlib.nullcontext() if training else torch.no_grad():
        _run(actions, run, no_sync, recorder, receives_ahead)
    return run.loss


def _run(actions: list[Action], run: _Executor, no_sync: Callable[[], ContextManager] | None,
         recorder: Recorder | None, receives_ahead: int) -> None:
    final = _last_backwards(actions)
    split = {(a.microbatch, a.stage) for a in actions if a.kind == "W"}
    run.sends_before = sends_before(actions)
    if recorder is not None:
        recorder.begin_step()
    for item in posting_order(actions, receives_ahead):
        try:
            if isinstance(item, list):
                run.post(item)
                continue
            run.poll_sends()
            last = final.get(item.stage) is item
            context = contextlib.nullcontext() if last or no_sync is None else no_sync()
            if item.kind == "F":
                run.forward(item)
            elif item.kind == "W":
                run.weight(item, context)
            else:
                run.backward(item, context, (item.microbatch, item.stage) in split)
        except Exception as exc:
            raise PipelineStepError(f"pipeline rank {run.rank} failed at {_show(item)}:\n"
                                f"{_marked_table(actions, item)}\n{type(exc).__name__}: {exc}") from exc
    run.finish()
    if recorder is not None:
        recorder.end_step()


def _show(item: Action | list[Action]) -> str:
    return " ".join(map(str, item)) if isinstance(item, list) else str(item)


def _marked_table(actions: list[Action], failed: Action | list[Action]) -> str:
    """This rank's table as text, the failing step in brackets."""
    marked = failed if isinstance(failed, list) else [failed]  # actions in a table are unique
    return "  " + " ".join(f"[{a}]" if a in marked else str(a) for a in actions)


def _last_backwards(actions: list[Action]) -> dict[int, Action]:
    """The final action writing each virtual stage's weight gradients (a W, or a B whose
    backward is whole): the only one allowed to reduce gradients."""
    split = {(a.microbatch, a.stage) for a in actions if a.kind == "W"}
    final = {}
    for a in actions:
        if a.kind == "W" or (a.kind == "B" and (a.microbatch, a.stage) not in split):
            final[a.stage] = a
    return final


def _check(actions: list[Action], run: _Executor) -> None:
    stages = sorted(run.chunk_of)
    held = [c.stage if isinstance(c, PipelineChunk) else s for c, s in zip(run.chunks, stages)]
    if len(stages) != len(run.chunks) or held != stages:
        raise ScheduleError(f"rank {run.rank} was given {len(run.chunks)} chunks (virtual stages "
                            f"{held}) but its table runs stages {stages}: build the table "
                            f"with chunks={len(run.chunks)}, the chunks with the schedule's "
                            f"placement, and use this rank's row")
    used = {a.microbatch for a in actions if a.kind == "F"}
    if used and max(used) >= len(run.microbatches):
        raise ScheduleError(f"the table runs {max(used) + 1} microbatches but "
                            f"{len(run.microbatches)} were given")


def gather_timeline(recorder: Recorder, pp_group: ProcessGroup, schedule: str,
                    microbatches: int, chunks: int = 1) -> Timeline:
    """Every pipeline rank's recorded steps, on every rank (collective over ``pp_group``);
    ``.save(path)`` it for ``paratrain trace --run``."""
    everyone: list = [None] * C.size(pp_group)
    dist.all_gather_object(everyone, recorder.to_dict(), group=pp_group)
    return Timeline.from_recorders(schedule, len(everyone), microbatches, chunks, everyone)
