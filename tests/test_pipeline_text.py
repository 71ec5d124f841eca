"""Pipeline tables as text: actions print and parse back (``1F3``), tables dump and load as
CSV, golden tables live here as text; a failing action names its rank's table with the
step marked; a sent activation's data is released once its send completes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_world
from paratrain.launch import RankFailed
from paratrain.parallel.pipeline import (Action, ScheduleError, dump_tables, load_tables,
                                         run_schedule, schedule)
from paratrain.parallel.pipeline.schedules import check_transfers

GOLDEN_1F1B_PP2_M4 = """
0F0,0SEND_F0>1,0F1,0SEND_F1>1,0RECV_B0<1,0B0,0F2,0SEND_F2>1,0RECV_B1<1,0B1,0F3,0SEND_F3>1,0RECV_B2<1,0B2,0RECV_B3<1,0B3
1RECV_F0<0,1F0,1RECV_F1<0,1B0,1SEND_B0>0,1F1,1B1,1SEND_B1>0,1RECV_F2<0,1F2,1B2,1SEND_B2>0,1RECV_F3<0,1F3,1B3,1SEND_B3>0
"""

GOLDEN_GPIPE_PP2_M2 = """
0F0,0SEND_F0>1,0F1,0SEND_F1>1,0RECV_B0<1,0B0,0RECV_B1<1,0B1
1RECV_F0<0,1F0,1RECV_F1<0,1F1,1B0,1SEND_B0>0,1B1,1SEND_B1>0
"""


@pytest.mark.parametrize("golden, args", [(GOLDEN_1F1B_PP2_M4, ("1f1b", 2, 4)),
                                          (GOLDEN_GPIPE_PP2_M2, ("gpipe", 2, 2))])
def test_golden_tables(golden, args):
    assert dump_tables(schedule(*args)) == golden.lstrip()
    check_transfers(load_tables(golden))


def test_every_table_round_trips_through_text():
    for kind, v, ps in (("gpipe", 1, (2, 3, 4)), ("1f1b", 1, (2, 3, 4)), ("interleaved", 2, (2, 4))):
        for p in ps:
            for m in (4, 8):
                tables = schedule(kind, p, m, v)
                assert load_tables(dump_tables(tables)) == tables
                assert all(Action.parse(str(a)) == a for t in tables for a in t)


def test_a_swapped_golden_table_is_refused():
    rows = GOLDEN_1F1B_PP2_M4.split()
    swapped = rows[1].replace("1SEND_B0>0", "X").replace("1SEND_B1>0", "1SEND_B0>0").replace("X", "1SEND_B1>0")
    with pytest.raises(ScheduleError, match="same order"):
        check_transfers(load_tables(rows[0] + "\n" + swapped))


@pytest.mark.parametrize("text", ["F3", "1X3", "1F", "1SEND_F3", "1F3>0", "1RECV_F3>0", ""])
def test_bad_action_text_names_the_form(text):
    with pytest.raises(ScheduleError, match="1F3|peer"):
        Action.parse(text)


class Chunk(nn.Module):
    """A stage of a toy pipeline: a linear map; the last stage returns a squared error."""

    def __init__(self, last: bool, fail_at: int = -1):
        super().__init__()
        self.lin, self.last, self.fail_at, self.calls = nn.Linear(8, 8), last, fail_at, 0
        self.outputs: list[torch.Tensor] = []

    def forward(self, x, targets, positions):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("injected failure")
        out = self.lin(x)
        self.outputs.append(out)
        return (out - targets).pow(2).sum() if self.last else out


def pipeline_world(fail_at: int):
    import torch.distributed as dist

    torch.manual_seed(0)
    rank = dist.get_rank()
    chunk = Chunk(last=rank == 1, fail_at=fail_at if rank == 1 else -1)
    micro = [(torch.randn(2, 4, 8), torch.randn(2, 4, 8)) for _ in range(4)]
    run_schedule(schedule("1f1b", 2, 4)[rank], [chunk], micro, dist.group.WORLD, 1.0,
                 torch.device("cpu"), act_shape=(2, 4, 8))
    return [o.numel() for o in chunk.outputs], chunk.lin.weight.grad is not None


def test_sent_outputs_are_released_and_a_failure_shows_the_marked_table():
    (sent, grad0), (kept, grad1) = run_world(pipeline_world, 2, -1)
    assert grad0 and grad1
    assert sent == [0, 0, 0, 0], "stage 0's sent activations should hold no data after their sends"
    assert kept == [64] * 4  # the last stage sends nothing
    with pytest.raises(RankFailed) as failure:
        run_world(pipeline_world, 2, 3)
    message = str(failure.value)
    assert "pipeline rank 1 failed at 1F2" in message and "[1F2]" in message
    assert "injected failure" in message
