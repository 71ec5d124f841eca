"""``paratrain train`` as the tasks of an ``srun`` step: one task per rank (docs/slurm.md).

srun starts every task itself and tells it who it is in its environment; paratrain reads
that here, as ``launch.torchrun_world`` reads torchrun's:

- ``SLURM_PROCID`` (the global rank), ``SLURM_STEP_NUM_TASKS`` (the world size),
  ``SLURM_LOCALID`` (the rank on its node, which picks the GPU), ``SLURM_NODEID`` and
  ``SLURM_STEP_TASKS_PER_NODE`` (the ranks on this node);
- the rendezvous: rank 0 hosts the store on the first node of ``SLURM_STEP_NODELIST``
  (task 0 runs there) at a port derived from the job and step ids, unless ``MASTER_ADDR``
  / ``MASTER_PORT`` say otherwise;
- the job: ``slurm-<SLURM_JOB_ID>`` and its attempt, ``SLURM_RESTART_COUNT``: a requeued
  job continues the run its first attempt placed, as a restarted torchrun job does.

Only an srun step of two tasks or more is a Slurm world: the batch script itself (no
``SLURM_STEP_ID``) and ``srun -n 1 paratrain train --nproc N`` use paratrain's own launcher.
"""

from __future__ import annotations

import re
from typing import Mapping

from .launch import WorldSpec, pick_backend
from .train.config import ConfigError

REQUIRED = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
            "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")
"""What srun sets for every task of a step, besides SLURM_STEP_ID and SLURM_STEP_NUM_TASKS."""
PORTS = (15000, 17000)
"""The derived rendezvous port is in [15000, 32000), below Linux's ephemeral ports."""


def started_by_srun(env: Mapping[str, str]) -> bool:
    """Whether this process is one task of an srun step of two tasks or more."""
    if "SLURM_STEP_ID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return False
    return _int(env, "SLURM_STEP_NUM_TASKS") > 1


def slurm_world(env: Mapping[str, str], backend: str = "auto", timeout_s: float = 300.0) -> WorldSpec:
    """The world of the srun step this task belongs to; ConfigError naming the variable
    that is missing or wrong."""
    missing = [k for k in REQUIRED if k not in env]
    if missing:
        raise ConfigError(f"srun step of {env.get('SLURM_STEP_NUM_TASKS')} tasks, but {', '.join(missing)} "
                          f"not set; srun sets them for every task: start paratrain with srun, or "
                          f"unset SLURM_STEP_ID to use paratrain's own launcher")
    world, rank, local = (_int(env, k) for k in ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID"))
    here = tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], _int(env, "SLURM_NODEID"))
    if not 0 <= rank < world:
        raise ConfigError(f"SLURM_PROCID={rank} is not a rank of SLURM_STEP_NUM_TASKS={world} tasks")
    if not 0 <= local < here:
        raise ConfigError(f"SLURM_LOCALID={local} is not one of the {here} tasks on node "
                          f"SLURM_NODEID={env['SLURM_NODEID']} (SLURM_STEP_TASKS_PER_NODE="
                          f"{env['SLURM_STEP_TASKS_PER_NODE']!r})")
    job, step = _int(env, "SLURM_JOB_ID"), _int(env, "SLURM_STEP_ID")
    host = env.get("MASTER_ADDR") or first_host(env["SLURM_STEP_NODELIST"])
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else rendezvous_port(job, step)
    return WorldSpec(rank=rank, world_size=world, local_rank=local, backend=pick_backend(backend),
                     init_method="env://", timeout_s=timeout_s, store_at=(host, port, False),
                     attempt=_int(env, "SLURM_RESTART_COUNT") if env.get("SLURM_RESTART_COUNT") else 0,
                     local_world_size=here, job=f"slurm-{env.get('SLURM_CLUSTER_NAME', '')}-{job}")


def rendezvous_port(job: int, step: int) -> int:
    """One port per job step, the same on every task (and in a requeued job's step)."""
    return PORTS[0] + (job * 8 + step) % PORTS[1]


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    m = re.fullmatch(r"([A-Za-z0-9._-]+)(?:\[([0-9]+)(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*\]([A-Za-z0-9._-]*))?"
                     r"(?:,.*)?", nodelist.strip())
    if not m:
        raise ConfigError(f"SLURM_STEP_NODELIST={nodelist!r} is not a Slurm host list")
    return m.group(1) + (m.group(2) or "") + (m.group(3) or "")


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Node ``node``'s count in srun's 'N(xK),M' form: '2(x3),1' has 2 tasks on nodes 0-2."""
    counts = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", item)
        if not m or int(m.group(1)) < 1:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} is not srun's "
                              f"'N(xK),M' form")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node < len(counts):
        raise ConfigError(f"SLURM_NODEID={node} is not one of the {len(counts)} nodes of "
                          f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node]


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"{key}={env[key]!r} is not an integer") from None
